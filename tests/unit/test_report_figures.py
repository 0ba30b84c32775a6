"""report.html's figures stay readable with eight runs overlaid: read from the SVG itself, no
legend's box holds a point of a plotted line, and the runs stay apart (a colour, a marker and a
line style each, no two runs alike)."""

from __future__ import annotations

import random
import re
import xml.etree.ElementTree as ET

from load_tests import html_report
from load_tests.clients import RequestRecord
from load_tests.stats import summarize

SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"
LEVELS = ["1 user", "4 users", "16 users", "32 users"]


def synthetic_run(i: int) -> html_report.Named:
    """A run of four levels whose latencies and rates grow with the load (runs differ)."""
    rng = random.Random(i)
    records = []
    for n, level in enumerate(LEVELS):
        for r in range(12):
            ttft = 0.05 * (1 + n) * (1 + i / 10) * rng.uniform(0.8, 1.2)
            latency = ttft + 0.5 * (1 + n) * rng.uniform(0.9, 1.1)
            tokens = 32
            chunks = [ttft + k * (latency - ttft) / (tokens - 1) for k in range(tokens)]
            start = r * 0.1
            records.append(
                RequestRecord(
                    level,
                    "http",
                    "chat",
                    start,
                    start,
                    ttft,
                    latency,
                    chunks,
                    10,
                    tokens,
                    verify_steps=20,
                    drafted=16,
                    accepted=8 + i,
                )
            )
    summaries = [summarize(level, [r for r in records if r.level == level]) for level in LEVELS]
    return html_report.Named(f"run {i}", list(LEVELS), summaries, records)


def _points(group: ET.Element) -> list[tuple[float, float]]:
    """Every point a group draws: its paths' vertices and its markers' places."""
    points = []
    for path in group.iter(f"{SVG}path"):
        numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", path.get("d", ""))]
        points += list(zip(numbers[::2], numbers[1::2], strict=False))
    for use in group.iter(f"{SVG}use"):
        if use.get("x") is not None:
            points.append((float(use.get("x", 0)), float(use.get("y", 0))))
    return points


def _text_points(group: ET.Element) -> list[tuple[float, float]]:
    points = []
    for node in group.iter():
        found = re.search(r"translate\(([-\d.e]+)[ ,]([-\d.e]+)\)", node.get("transform", ""))
        if found:
            points.append((float(found.group(1)), float(found.group(2))))
    return points


def legends_and_lines(svg: str) -> tuple[list[tuple[float, ...]], list[tuple[float, float]]]:
    """(each legend's box, every point of the plotted lines outside legends)."""
    root = ET.fromstring(svg)
    boxes, inside = [], set()
    for group in root.iter(f"{SVG}g"):
        if (group.get("id") or "").startswith("legend"):
            pts = _points(group) + _text_points(group)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            boxes.append((min(xs), min(ys), max(xs), max(ys)))
            inside |= {id(g) for g in group.iter(f"{SVG}g")}
    lines = []
    for group in root.iter(f"{SVG}g"):
        if (group.get("id") or "").startswith("line2d") and id(group) not in inside:
            lines += _points(group)
    return boxes, lines


def test_eight_runs_overlaid_keep_their_legends_off_the_data() -> None:
    runs = [synthetic_run(i) for i in range(8)]
    checked = 0
    for figure in html_report.figures(runs):
        boxes, lines = legends_and_lines(figure.svg)
        assert figure.points > 0, figure.id
        if figure.id != "timeline":  # its bars are not lines; its legend is below too
            assert boxes and lines, figure.id
        for x0, y0, x1, y1 in boxes:
            covered = [(x, y) for x, y in lines if x0 <= x <= x1 and y0 <= y <= y1]
            assert not covered, (figure.id, (x0, y0, x1, y1), covered[:3])
            checked += 1
    assert checked >= 5


def test_runs_differ_in_colour_marker_and_line_style() -> None:
    styles = {tuple(sorted(html_report._run_style(i).items())) for i in range(8)}
    assert len(styles) == 8
    pairs = {(html_report._run_style(i)["marker"], html_report._run_style(i)["linestyle"])
             for i in range(8)}  # fmt: skip
    assert len(pairs) == 8  # apart in greyscale too
