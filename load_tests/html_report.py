"""`report.html`: a run's figures (or several runs' on the same axes) in one self-contained file.

matplotlib draws each figure as SVG, kept inline with its text as text, so the page needs no
network access, no script and no other file; a browser, or any SVG viewer, opens it. Each figure
is a `<figure id=...>` with `data-points`, the number of data points drawn in it (a test reads
that, and a reader sees at once when a figure has nothing in it). The numbers come from the same
summaries as report.md (load_tests/stats.py).
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: the figures only become SVG text

import matplotlib.pyplot as plt

from load_tests.clients import RequestRecord
from load_tests.stats import LevelSummary

PERCENTILES = ("p50", "p90", "p99")
# Up to eight runs overlaid stay apart in greyscale too: each run its own colour, marker and
# line style (markers and styles cycle on different lengths, so no two of eight runs share both).
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_PERCENTILE_STYLES: dict[str, Any] = {"p50": "-", "p90": "--", "p99": ":"}
_HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "--", "++")


def _run_style(i: int) -> dict[str, Any]:
    return {"color": f"C{i % 10}", "marker": _MARKERS[i % 8], "linestyle": _STYLES[i % 4]}


def _shared_legend(fig: Any, handles: list[Any], labels: list[str], title: str = "") -> None:
    """One legend for the whole figure, below its axes: it never covers a plotted point."""
    if not handles:
        return
    fig.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(len(labels), 4),
        fontsize="small",
        frameon=False,
        title=title or None,
    )


# Figure ids, in page order: what a report.html holds (tests check each one).
FIGURES = (
    "throughput",
    "latency-percentiles",
    "latency-distribution",
    "acceptance",
    "timeline",
)


@dataclass(frozen=True, slots=True)
class Named:
    """One run as the page shows it: its name (a title or folder), its levels' summaries in
    order, and its requests."""

    name: str
    levels: list[str]
    summaries: list[LevelSummary]
    records: list[RequestRecord]


@dataclass(frozen=True, slots=True)
class Figure:
    id: str
    title: str
    caption: str
    svg: str
    points: int


def svg(fig: Any) -> str:
    out = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, small
        fig.savefig(out, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg") :]  # the inline element, without the XML prologue


def _levels(runs: Sequence[Named]) -> list[str]:
    """Every level name, in first-seen order: runs are matched by level name."""
    levels: list[str] = []
    for run in runs:
        levels += [level for level in run.levels if level not in levels]
    return levels


def _series(run: Named, levels: list[str], value: Any) -> tuple[list[int], list[float]]:
    """(x positions, values) of a run's levels for which `value(summary)` is a number."""
    by_level = {s.level: s for s in run.summaries}
    xs, ys = [], []
    for x, level in enumerate(levels):
        summary = by_level.get(level)
        y = None if summary is None else value(summary)
        if y is not None and y == y:  # not NaN
            xs.append(x)
            ys.append(float(y))
    return xs, ys


def _load_axis(ax: Any, levels: list[str]) -> None:
    ax.set_xticks(range(len(levels)), levels, rotation=20 if len(levels) > 4 else 0)
    ax.set_xlabel("load level")
    ax.grid(alpha=0.3)


def _label(run: Named, runs: Sequence[Named], what: str = "") -> str:
    if len(runs) == 1:
        return what or run.name
    return f"{run.name} {what}".strip()


def throughput(runs: Sequence[Named]) -> Figure:
    levels = _levels(runs)
    fig, (tokens, requests) = plt.subplots(1, 2, figsize=(11, 3.8))
    points = 0
    for i, run in enumerate(runs):
        for ax, value in (
            (tokens, lambda s: s.output_tokens_per_s),
            (requests, lambda s: s.requests_per_s),
        ):
            xs, ys = _series(run, levels, value)
            ax.plot(xs, ys, label=run.name, **_run_style(i))
            points += len(xs)
    tokens.set_ylabel("output tokens/s")
    requests.set_ylabel("requests/s")
    for ax in (tokens, requests):
        _load_axis(ax, levels)
    if len(runs) > 1:
        _shared_legend(fig, *tokens.get_legend_handles_labels())
    caption = "Successful requests' output tokens and requests per second, per load level."
    return Figure("throughput", "Throughput against load", caption, svg(fig), points)


def latency_percentiles(runs: Sequence[Named]) -> Figure:
    """One run: a colour a percentile. Several: a colour (and marker) a run, a line style a
    percentile, with a legend for each below the axes."""
    levels = _levels(runs)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    points = 0
    metrics = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"))
    one = len(runs) == 1
    for ax, (title, field) in zip(axes, metrics, strict=True):
        for i, run in enumerate(runs):
            for j, q in enumerate(PERCENTILES):

                def value(s: LevelSummary, field: str = field, q: str = q) -> float | None:
                    spread: dict[str, float] = getattr(s, field)
                    return None if q not in spread else spread[q] * 1000

                xs, ys = _series(run, levels, value)
                style = _run_style(j if one else i) | {"linestyle": _PERCENTILE_STYLES[q]}
                ax.plot(xs, ys, label=q if one else run.name, **style)
                points += len(xs)
        ax.set_title(title)
        ax.set_ylabel("ms")
        _load_axis(ax, levels)
    handles, labels = axes[0].get_legend_handles_labels()
    if one:
        _shared_legend(fig, handles, labels)
    else:  # each run once (its p50 line), and the percentiles' line styles apart
        runs_at = list(range(0, len(handles), len(PERCENTILES)))
        _shared_legend(fig, [handles[k] for k in runs_at], [labels[k] for k in runs_at])
        styles = [
            plt.Line2D([], [], color="black", linestyle=_PERCENTILE_STYLES[q]) for q in PERCENTILES
        ]
        axes[-1].legend(
            styles, PERCENTILES, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small"
        )
    caption = (
        "p50, p90 and p99 per level over successful requests: time to first token, time per "
        "output token after the first, and the gaps between streamed pieces."
    )
    return Figure(
        "latency-percentiles", "Latency percentiles against load", caption, svg(fig), points
    )


def latency_distribution(runs: Sequence[Named]) -> Figure:
    levels = _levels(runs)
    fig, (latency, ttft) = plt.subplots(1, 2, figsize=(12, 4))
    points = 0
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        for ax, value in (
            (latency, lambda r: r.latency),
            (ttft, lambda r: None if r.ttft is None else r.ttft * 1000),
        ):
            data, positions = [], []
            for x, level in enumerate(levels):
                values = [
                    v
                    for r in run.records
                    if r.level == level and r.ok
                    if (v := value(r)) is not None
                ]
                if values:
                    data.append(values)
                    positions.append(x - 0.4 + width * (i + 0.5))
                    points += len(values)
            if data:
                boxes = ax.boxplot(
                    data,
                    positions=positions,
                    widths=width * 0.9,
                    patch_artist=True,
                    manage_ticks=False,
                )
                for patch in boxes["boxes"]:
                    patch.set_facecolor(f"C{i}")
                    patch.set_alpha(0.6)
                    patch.set_hatch(_HATCHES[i % 8])  # apart in greyscale too
                    patch.set_label(run.name)
    latency.set_ylabel("request latency (s)")
    ttft.set_ylabel("TTFT (ms)")
    for ax in (latency, ttft):
        _load_axis(ax, levels)
    if len(runs) > 1:
        handles = [
            plt.Rectangle((0, 0), 1, 1, facecolor=f"C{i}", alpha=0.6, hatch=_HATCHES[i % 8])
            for i in range(len(runs))
        ]
        _shared_legend(fig, handles, [r.name for r in runs])
    caption = (
        "Each level's successful requests: box from the 25th to the 75th percentile, the "
        "median across it, whiskers to 1.5 times the box, outliers as circles."
    )
    return Figure(
        "latency-distribution", "Latency distribution per level", caption, svg(fig), points
    )


def acceptance(runs: Sequence[Named]) -> Figure:
    levels = _levels(runs)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    points = 0
    for i, run in enumerate(runs):
        xs, ys = _series(run, levels, lambda s: s.mean_acceptance_length)
        ax.plot(xs, ys, label=run.name, **_run_style(i))
        points += len(xs)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("tokens per verify step")
    _load_axis(ax, levels)
    if len(runs) > 1:
        _shared_legend(fig, *ax.get_legend_handles_labels())
    caption = (
        "Mean acceptance length: tokens committed per verify step (accepted drafts + 1) over "
        "each level's successful requests, from their usage; 1 is decoding without speculation."
    )
    return Figure("acceptance", "Acceptance length per level", caption, svg(fig), points)


def _placed(run: Named) -> list[tuple[float, RequestRecord]]:
    """Each request with its start on one clock: levels run one after another, so each level
    starts where the one before ended."""
    placed: list[tuple[float, RequestRecord]] = []
    offset = 0.0
    for level in run.levels:
        records = [r for r in run.records if r.level == level]
        placed += [(offset, r) for r in records]
        ends = [max(r.scheduled, r.start) + (r.latency or 0.0) for r in records]
        offset += max(ends, default=0.0)
    return placed


def timeline(runs: Sequence[Named]) -> Figure:
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12, 1.2 + 3.2 * len(runs)), squeeze=False, layout="constrained"
    )
    points = 0
    for ax, run in zip(axes[:, 0], runs, strict=True):
        placed = _placed(run)
        for row, (offset, r) in enumerate(placed):
            due, start = offset + r.scheduled, offset + r.start
            end = start + (r.latency or 0.0)
            if start > due:
                ax.broken_barh([(due, start - due)], (row, 0.8), color="lightgrey")
            if not r.ok:
                ax.broken_barh([(start, max(end - start, 1e-3))], (row, 0.8), color="tab:red")
            else:
                first = start + (r.ttft or 0.0)
                ax.broken_barh([(start, first - start)], (row, 0.8), color="tab:orange")
                ax.broken_barh([(first, end - first)], (row, 0.8), color="tab:blue")
            points += 1
        boundaries = sorted({offset for offset, _ in placed})
        for x in boundaries[1:]:
            ax.axvline(x, color="black", linewidth=0.6, linestyle="--")
        ax.set_ylabel("request")
        ax.set_title(run.name if len(runs) > 1 else "", fontsize="medium")
        ax.set_ylim(0, max(len(placed), 1))
        ax.set_xlim(left=0)
    axes[-1, 0].set_xlabel("seconds from the first level's start")  # once, under the last
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for c in ("lightgrey", "tab:orange", "tab:blue", "tab:red")
    ]
    _shared_legend(fig, handles, ["queued (open loop)", "to first token", "streaming", "failed"])
    caption = (
        "Each request as a bar: queued after it was due (open loop), until its first token, "
        "then streaming until its end; a failed request in red. Dashed lines separate levels. "
        "A stall shows as bars that stop advancing together."
    )
    return Figure("timeline", "Requests on a timeline", caption, svg(fig), points)


def figures(runs: Sequence[Named]) -> list[Figure]:
    return [
        throughput(runs),
        latency_percentiles(runs),
        latency_distribution(runs),
        acceptance(runs),
        timeline(runs),
    ]


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
figure { margin: 2em 0; } figcaption { color: #555; max-width: 60em; }
svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ccc;
padding: 0.2em 0.5em; text-align: right; } th { background: #f4f4f4; }
"""


def _table(runs: Sequence[Named]) -> str:
    head = (
        "run",
        "level",
        "ok / sent",
        "output tok/s",
        "req/s",
        "TTFT p50 (ms)",
        "TPOT p50 (ms)",
        "acceptance length",
    )
    rows = []
    for run in runs:
        for s in run.summaries:
            ttft, tpot = s.ttft_s.get("p50"), s.tpot_s.get("p50")
            cells = (
                run.name,
                s.level,
                f"{s.ok} / {s.sent}",
                f"{s.output_tokens_per_s:.1f}",
                f"{s.requests_per_s:.2f}",
                "-" if ttft is None else f"{ttft * 1000:.0f}",
                "-" if tpot is None else f"{tpot * 1000:.0f}",
                "-" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}",
            )
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def render(title: str, lines: Sequence[str], runs: Sequence[Named]) -> str:
    """The whole page: a title, what ran (`lines`), a summary table and the figures."""
    return page(title, lines, _table(runs), figures(runs))


def page(title: str, lines: Sequence[str], table: str, shown: Sequence[Figure]) -> str:
    """A self-contained page: a title, what ran (`lines`), a table (HTML) and figures."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>",
        table,
    ]
    for figure in shown:
        parts.append(
            f'<figure id="{figure.id}" data-points="{figure.points}">'
            f"<h2>{html.escape(figure.title)}</h2>{figure.svg}"
            f"<figcaption>{html.escape(figure.caption)}</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
