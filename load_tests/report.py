"""Load-test reports: a run's folder (`summary.json` with what ran and the routers' view of each
level, `results.jsonl` with every request) becomes Markdown. The request-level numbers are
recomputed from `results.jsonl`, so a report can be rebuilt, or several runs set side by side."""

from __future__ import annotations

import json
import math
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load_tests import html_report
from load_tests.clients import RequestRecord
from load_tests.server_metrics import ServerView
from load_tests.stats import LevelSummary, Slo, percentile, summarize

REPORTS = Path(__file__).resolve().parent / "reports"  # where runs are written by default

SUMMARY = "summary.json"
RESULTS = "results.jsonl"
REPORT = "report.md"
HTML_REPORT = "report.html"


@dataclass
class Run:
    """A finished run as saved: what ran (`info`), its levels in order, and every request."""

    info: dict[str, Any]
    levels: list[str]
    records: list[RequestRecord]
    servers: dict[str, ServerView | None]

    @property
    def slo(self) -> Slo:
        return Slo(**self.info.get("slo", {}))

    def summaries(self) -> list[LevelSummary]:
        """Each level's summary, with its requests that repeat an earlier one's workload item
        (warm-up requests are not recorded, so they do not count)."""
        summaries: list[LevelSummary] = []
        seen: set[int] = set()
        for level in self.levels:
            records = [r for r in self.records if r.level == level]
            repeats = 0
            for record in records:  # in the order they were due
                if record.item >= 0:
                    repeats += record.item in seen
                    seen.add(record.item)
            summaries.append(summarize(level, records, self.slo, repeats))
        return summaries


def save(folder: Path, run: Run) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / RESULTS).open("w") as out:
        for record in run.records:
            out.write(json.dumps(record.to_json()) + "\n")
    levels = []
    for summary in run.summaries():
        server = run.servers.get(summary.level)
        levels.append(
            {"summary": summary.to_json(), "server": None if server is None else server.to_json()}
        )
    (folder / SUMMARY).write_text(json.dumps({**run.info, "levels": levels}, indent=2) + "\n")
    (folder / REPORT).write_text(render(run))
    (folder / HTML_REPORT).write_text(render_html(run, folder.name))


def load(folder: Path) -> Run:
    summary = json.loads((folder / SUMMARY).read_text())
    rows = summary.pop("levels")
    records = [
        RequestRecord.from_json(json.loads(line))
        for line in (folder / RESULTS).read_text().splitlines()
        if line.strip()
    ]
    levels = [row["summary"]["level"] for row in rows]
    servers = {
        row["summary"]["level"]: None
        if row["server"] is None
        else ServerView.from_json(row["server"])
        for row in rows
    }
    return Run(summary, levels, records, servers)


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def _spread_ms(spread: dict[str, float], *keys: str) -> str:
    return " / ".join(_ms(spread.get(k)) for k in keys) if spread else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (the benchmarks' tables too: tests/benchmarks/report.py)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def client_line() -> str:
    """The machine a load generator ran on, as a report names it."""
    node, cpu, cores = platform.node(), cpu_name(), os.cpu_count()
    return f"{node}, {cpu}, {cores} cores, Python {platform.python_version()}"


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model, as reports name it: with its family and model numbers where
    the file gives them, as a VM's model name ("AMD EPYC") names no generation, and two VMs of
    one name can differ by a third in speed."""
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    if found is None:
        return platform.processor() or platform.machine()
    name = found.group(1).strip()
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.MULTILINE)
    model = re.search(r"^model\s*:\s*(\d+)", text, re.MULTILINE)
    if family and model:
        name += f" family {family.group(1)} model {model.group(1)}"
    return name


def client_table(summaries: Sequence[LevelSummary], slo: Slo) -> str:
    headers = [
        "level",
        "ok / sent",
        "repeats",
        "refused",
        "req/s",
        "output tok/s",
        "TTFT p50 / p90 / p99 (ms)",
        "TPOT p50 / p90 (ms)",
        "ITL p50 / p99 (ms)",
        "latency p50 / p99 (s)",
        "acceptance length",
    ]
    if slo.ttft_s is not None or slo.tpot_s is not None:
        headers.append("goodput (req/s)")
    rows = []
    for s in summaries:
        refused = ", ".join(f"{n}x {code}" for code, n in sorted(s.refused.items())) or "-"
        row: list[object] = [
            s.level,
            f"{s.ok} / {s.sent}",
            s.repeats,
            refused,
            f"{s.requests_per_s:.2f}",
            f"{s.output_tokens_per_s:.1f}",
            _spread_ms(s.ttft_s, "p50", "p90", "p99"),
            _spread_ms(s.tpot_s, "p50", "p90"),
            _spread_ms(s.itl_s, "p50", "p99"),
            " / ".join(_s(s.latency_s.get(k)) for k in ("p50", "p99")) if s.latency_s else "-",
            "-" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}",
        ]
        if len(headers) > len(row):
            row.append("-" if s.goodput_per_s is None else f"{s.goodput_per_s:.2f}")
        rows.append(row)
    return table(headers, rows)


def server_table(summaries: Sequence[LevelSummary], servers: dict[str, ServerView | None]) -> str:
    headers = [
        "level",
        "router outcomes",
        "routed by",
        "tokens generated (router / client)",
        "drafted / accepted",
        "mean TTFT at the router (ms)",
        "max in flight",
        "max queue by group",
        "max KV use by group",
        "polls (failed)",
    ]
    rows = []
    for s in summaries:
        view = servers.get(s.level)
        if view is None:
            rows.append([s.level, *["-"] * (len(headers) - 1)])
            continue
        c = view.counters
        rows.append(
            [
                s.level,
                ", ".join(f"{n:g} {k}" for k, n in sorted(view.requests.items())) or "-",
                ", ".join(f"{n:g} {k}" for k, n in sorted(view.routed.items())) or "-",
                f"{c.get('generated', 0):g} / {s.output_tokens}",
                f"{c.get('drafted', 0):g} / {c.get('accepted', 0):g}",
                _ms(view.mean_ttft),
                f"{view.max_in_flight:g}",
                ", ".join(f"{g} {v:g}" for g, v in sorted(view.max_queue.items())) or "-",
                ", ".join(f"{g} {v:.0%}" for g, v in sorted(view.max_kv_usage.items())) or "-",
                f"{view.polls} ({view.failed_polls})",
            ]
        )
    return table(headers, rows)


def turn_table(run: Run) -> str:
    """Per level and turn of a conversation: later turns resend the history, which the
    verifiers' prefix caches hold."""
    rows = []
    for level in run.levels:
        records = [r for r in run.records if r.level == level]
        for turn in sorted({r.turn for r in records}):
            same = [r for r in records if r.turn == turn]
            ok = [r for r in same if r.ok]
            ttfts = [r.ttft for r in ok if r.ttft is not None]
            prompt = sum(r.prompt_tokens for r in ok) / len(ok) if ok else math.nan
            rows.append(
                [
                    level,
                    turn,
                    f"{len(ok)} / {len(same)}",
                    " / ".join(_ms(percentile(ttfts, q)) for q in (50, 90)),
                    "-" if math.isnan(prompt) else f"{prompt:.0f}",
                ]
            )
    headers = ["level", "turn", "ok / sent", "TTFT p50 / p90 (ms)", "prompt tokens (mean)"]
    return table(headers, rows)


def _workload_line(workload: dict[str, Any], seed: object) -> str:
    random = workload.get("random")
    if random is not None:
        low, high = random["token_range"]
        spread = f" (within {random['range_ratio']:.0%})" if random["range_ratio"] else ""
        return (
            f"- Workload: random token ids in [{low}, {high}), {random['input_len']} prompt "
            f"tokens and {random['output_len']} new tokens a request{spread}; seed {seed}"
        )
    return (
        f"- Workload: `{workload.get('path')}` (sha256 {workload.get('digest')}, "
        f"{workload.get('items')} requests, reshuffled each pass; seed {seed})"
    )


def render(run: Run) -> str:
    info, summaries = run.info, run.summaries()
    sampling = info.get("sampling", {})
    workload = info.get("workload", {})
    lines = [
        f"# Load test: {info.get('title') or info.get('url', '')}",
        "",
        f"- Started {info.get('started', '?')}, `{info.get('command', '')}`",
        f"- Target: {info.get('url', '?')} over {info.get('api', '?')}, "
        f"model `{info.get('model')}`",
        _workload_line(workload, info.get("seed")),
        f"- Each request: up to {sampling.get('max_tokens')} new tokens (unless the workload "
        f"says), temperature {sampling.get('temperature')}, "
        + _speculation(sampling)
        + (", ignore EOS" if sampling.get("ignore_eos") else ""),
        f"- Client: {info.get('client', '?')}",
        "",
        "## What the clients saw",
        "",
        client_table(summaries, run.slo),
        "",
        *(
            ["## By turn of a conversation", "", turn_table(run), ""]
            if any(r.turn > 1 for r in run.records)
            else []
        ),
        "## What the routers reported",
        "",
        server_table(summaries, run.servers),
        "",
        _DEFINITIONS,
    ]
    return "\n".join(lines) + "\n"


def _named(name: str, run: Run) -> html_report.Named:
    return html_report.Named(name, list(run.levels), run.summaries(), run.records)


def render_html(run: Run, name: str) -> str:
    """report.html: the run's figures (load_tests/html_report.py)."""
    info = run.info
    lines = [
        f"Started {info.get('started', '?')}: {info.get('command', '')}",
        f"Target: {info.get('url', '?')} over {info.get('api', '?')}, model {info.get('model')}",
        _workload_line(info.get("workload", {}), info.get("seed")).removeprefix("- "),
        "Each request: " + _speculation(info.get("sampling", {})),
        f"Client: {info.get('client', '?')}",
    ]
    title = f"Load test: {info.get('title') or info.get('url', name)}"
    return html_report.render(title, lines, [_named(info.get("title") or name, run)])


def compare_html(runs: Sequence[tuple[str, Run]]) -> str:
    """The runs' figures on the same axes, levels matched by name."""
    lines = [f"{name}: {run.info.get('command', '')}" for name, run in runs]
    return html_report.render(
        "Load tests side by side", lines, [_named(name, run) for name, run in runs]
    )


def _speculation(sampling: dict[str, Any]) -> str:
    if not sampling.get("speculation", True):
        return "no speculation"
    method, k = sampling.get("spec_method"), sampling.get("num_spec_tokens")
    if not method and not k:
        return "speculation as served"
    return f"speculation {method or 'as served'}" + (f" with k = {k}" if k else "")


_DEFINITIONS = """\
TTFT: from sending the request to the first streamed text. TPOT: (latency - TTFT) / (output
tokens - 1) per request. ITL: the gaps between streamed pieces of text; with speculation a piece
can carry several tokens (a verify step's accepted drafts), so ITL is per piece, not per token.
Latency: sending to the stream's end. Repeats: requests whose input an earlier request of the
run (warm-up aside) already sent; the verifiers' prefix caches and the shared n-gram pool make
those cheaper, and greedy answers repeat too. Rates count a level from its first send to its
last request's end. Acceptance length: tokens committed per verify step over the level's
successful requests (from their usage). Refused: requests that did not succeed, by HTTP status
or gRPC code (`timeout`, `connection`, `bad-response`, a stream not in OpenAI's format, and
`failed`, a failure after the stream began, are the client's names). The routers' columns are
the growth of their Prometheus counters (`routed by`: the routing decisions' reasons, `prefix`
where a cached prefix chose the group) over the level and the highest gauges seen while polling;
`tokens generated` counts every request the routers served in that time, so it exceeds the
client's count when other traffic was present."""


def compare(runs: Sequence[tuple[str, Run]]) -> str:
    """Output tokens/s and TTFT p50 of several runs, level by level (levels matched by name)."""
    levels: list[str] = []
    for _, run in runs:
        levels += [level for level in run.levels if level not in levels]
    by_run = [{s.level: s for s in run.summaries()} for _, run in runs]
    headers = ["level"] + [f"{name}: tok/s, TTFT p50 (ms)" for name, _ in runs]
    rows = []
    for level in levels:
        row: list[object] = [level]
        for summaries in by_run:
            s = summaries.get(level)
            row.append(
                "-" if s is None else f"{s.output_tokens_per_s:.1f}, {_ms(s.ttft_s.get('p50'))}"
            )
        rows.append(row)
    return "# Load tests side by side\n\n" + table(headers, rows) + "\n"
