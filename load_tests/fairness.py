"""`python -m load_tests fairness`: does one API key flooding a running server at its limits slow
another key down, do two busy keys share the server by their weights, and do urgent requests go
first?

Two keys (`--victim-key`, `--flood-key`, or the first two lines of `--api-keys-file`). The victim
sends the workload's first `--requests` requests from `--users` users (closed loop), after a
warm-up, in these phases:

- **alone**: the flooder idle; the victim's own times.
- **flood, N users** (a phase for each N of `--flood-users`): the flooder's users send as fast
  as they are let; what sharing the server costs the victim, against alone.
- **priority**: the heaviest flood again, its requests at `--batch-priority` (10: less urgent);
  the victim's (priority 0) are urgent requests beside a saturating batch.
- **shares**: both keys busy, `--share-users` users each, for `--share-seconds`: each key's
  generated tokens per second over the window (a request running at its end counts what it
  had streamed), its share against its weight, and the second key's refusals.
- **alone, after**: that nothing lingers.

A refused flood request is sent again after `--flood-retry-s` (the default ignores the
server's Retry-After, as an abusive client would). With as many flood users as the flooder's
`concurrency=` it uses its allowance without being refused; more users add what refusing them
costs. The report (fairness.md, fairness.json, and fairness.html with the figures) gives per
phase the victim's median and p90 TTFT and median latency, the flooder's requests served and
refused (429: its concurrency, request or token limits), and in the shares phase each key's
tokens per second. The server's keys file decides what each key may take (`concurrency=`,
`tokens_per_s=`, `weight=`) and its `engine.max_step_share` how much of a step one key fills.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import itertools
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from load_tests import html_report
from load_tests.clients import Client, HttpClient, RequestRecord, Sampling, served_model
from load_tests.report import REPORTS, client_line
from load_tests.runner import Level, run_level
from load_tests.stats import percentile
from load_tests.workload import WorkItem, load_workload


@dataclass(slots=True)
class PhaseResult:
    name: str
    requests: int
    completed: int
    ttft_p50_s: float
    ttft_p90_s: float
    latency_p50_s: float
    flood_served: int = 0
    flood_refused: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # the flooder's, by status
    # The shares phase: each key's generated tokens per second while both are busy.
    victim_tokens_per_s: float = 0.0
    flood_tokens_per_s: float = 0.0

    @property
    def flooded(self) -> bool:
        return self.flood_served + self.flood_refused > 0

    @property
    def victim_share(self) -> float:
        total = self.victim_tokens_per_s + self.flood_tokens_per_s
        return self.victim_tokens_per_s / total if total else float("nan")


async def run_fairness(args: argparse.Namespace, command: str) -> Path:
    """The three phases against the server at `args.url`; the report's path."""
    victim_key, flood_key = _keys(args)
    stream = load_workload(args.workload).stream(0)
    items = list(itertools.islice(stream, args.requests))
    flood_items = list(itertools.islice(stream, 64))
    headers = {"Authorization": f"Bearer {victim_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        model = await served_model(session, args.url)
    sampling = Sampling(model=model, max_tokens=args.max_tokens, timeout_s=args.timeout)
    flood_sampling = replace(sampling, max_tokens=args.flood_max_tokens)
    victim = HttpClient(args.url, sampling, victim_key)
    flooder = HttpClient(args.url, flood_sampling, flood_key)
    batch = HttpClient(args.url, replace(flood_sampling, priority=args.batch_priority), flood_key)
    heaviest = max(args.flood_users, default=0)
    phases: list[tuple[str, HttpClient | None, int]] = [("alone", None, 0)]
    for users in args.flood_users:
        phases.append((f"flood, {users} user{'s' if users > 1 else ''}", flooder, users))
    if heaviest and args.batch_priority is not None:
        phases.append(("priority", batch, heaviest))
    results = []
    clients = [victim, flooder, batch]
    try:
        await run_level(victim, Level(len(items), concurrency=args.users), iter(items))  # warm-up
        for name, flooding, flood_users in phases:
            print(f"phase {name}: {len(items)} requests, {args.users} users", flush=True)
            results.append(
                await run_phase(
                    name,
                    victim,
                    items,
                    args.users,
                    flooding,
                    flood_items,
                    flood_users,
                    args.flood_retry_s,
                )
            )
        if args.share_users:
            print(f"phase shares: {args.share_users} users a key", flush=True)
            both = replace(flood_sampling)
            clients.append(busy := HttpClient(args.url, both, victim_key))
            results.append(
                await run_shares(busy, flooder, flood_items, args.share_users, args.share_seconds)
            )
        print("phase alone, after", flush=True)
        results.append(await run_phase("alone, after", victim, items, args.users, None, [], 0))
    finally:
        for client in clients:
            await client.close()
    info = {
        "command": command,
        "server": f"{model} at {args.url}",
        "users": args.users,
        "flood_users": args.flood_users,
        "flood_retry_s": args.flood_retry_s,
        "requests": len(items),
        "max_tokens": args.max_tokens,
        "flood_max_tokens": args.flood_max_tokens,
        "batch_priority": args.batch_priority,
        "share_users": args.share_users,
        "share_seconds": args.share_seconds,
        "client": client_line(),
    }
    path = save(args.out or REPORTS / time.strftime("fairness-%Y%m%d-%H%M%S"), results, info)
    print(render(results, info))
    if args.docs is not None:
        write_docs(args.docs, results, info)
        print(f"wrote the fairness section of {args.docs}")
    return path


def _keys(args: argparse.Namespace) -> tuple[str, str]:
    if args.victim_key and args.flood_key:
        return args.victim_key, args.flood_key
    if args.api_keys_file is None:
        raise ValueError("give --victim-key and --flood-key, or --api-keys-file")
    from router.keys import read_keys_file

    lines = read_keys_file(args.api_keys_file)
    if len(lines) < 2:
        raise ValueError(f"{args.api_keys_file}: needs two keys (victim, flood)")
    return lines[0].key, lines[1].key


async def run_phase(
    name: str,
    victim: Client,
    items: list[WorkItem],
    users: int,
    flooder: Client | None,
    flood_items: list[WorkItem],
    flood_users: int,
    retry_s: float = 0.05,
) -> PhaseResult:
    """The victim's requests, with the flooder sending meanwhile when given one."""
    stop = asyncio.Event()
    counts: dict[str, int] = {}

    async def flood(user: int) -> None:
        assert flooder is not None
        for number in _cycle(len(flood_items), user):
            if stop.is_set():
                return
            record = RequestRecord(name, flooder.api, "flood", 0.0)
            await flooder.send(flood_items[number], record)
            counts[record.status] = counts.get(record.status, 0) + 1
            if not record.ok:
                await asyncio.sleep(retry_s)

    flooding = [asyncio.ensure_future(flood(u)) for u in range(flood_users if flooder else 0)]
    try:
        if flooding:
            await asyncio.sleep(1.0)  # the flood at its limits before the victim starts
        records = await run_level(victim, Level(len(items), concurrency=users), iter(items))
    finally:
        stop.set()
        await asyncio.gather(*flooding, return_exceptions=True)
    return summarize(name, records, counts)


async def run_shares(
    first: Client, second: Client, items: list[WorkItem], users: int, seconds: float
) -> PhaseResult:
    """Both keys busy (`users` each, closed loop) for `seconds`: each one's generated tokens
    per second over the window. A request still running at its end counts the tokens it had
    streamed by then (its tokens times the share of its streamed pieces that came before the
    end); the second key's refusals are counted by status."""
    stop = asyncio.Event()
    stop_at = math.inf
    tokens = {"first": 0.0, "second": 0.0}
    flood_statuses: Counter[str] = Counter()

    async def user(client: Client, which: str, start: int) -> None:
        for number in _cycle(len(items), start):
            if stop.is_set():
                return
            record = RequestRecord("shares", client.api, which, 0.0)
            sent = time.perf_counter()
            await client.send(items[number], record)
            if which == "second":
                flood_statuses[record.status] += 1
            if record.ok:
                tokens[which] += _tokens_before(record, stop_at - sent)

    tasks = [asyncio.ensure_future(user(first, "first", u)) for u in range(users)]
    tasks += [asyncio.ensure_future(user(second, "second", users + u)) for u in range(users)]
    await asyncio.sleep(seconds)
    stop_at = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return replace(
        summarize("shares", [], dict(flood_statuses)),
        victim_tokens_per_s=tokens["first"] / seconds,
        flood_tokens_per_s=tokens["second"] / seconds,
    )


def _tokens_before(record: RequestRecord, end: float) -> float:
    """The tokens `record` streamed before `end` (seconds from its start): all of them where it
    ended before, else its tokens times the share of its streamed pieces that came before."""
    if record.latency is not None and record.latency <= end:
        return float(record.output_tokens)
    if not record.chunks:
        return 0.0
    before = sum(1 for t in record.chunks if t <= end)
    return record.output_tokens * before / len(record.chunks)


def _cycle(n: int, start: int) -> Iterator[int]:
    index = start
    while True:
        yield index % n
        index += 1


def summarize(name: str, records: list[RequestRecord], counts: dict[str, int]) -> PhaseResult:
    ttfts = [r.ttft for r in records if r.ok and r.ttft is not None]
    latencies = [r.latency for r in records if r.ok and r.latency is not None]
    refusals = {status: n for status, n in counts.items() if status != "ok"}
    return PhaseResult(
        name=name,
        requests=len(records),
        completed=sum(r.ok for r in records),
        ttft_p50_s=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p90_s=percentile(ttfts, 90) if ttfts else float("nan"),
        latency_p50_s=statistics.median(latencies) if latencies else float("nan"),
        flood_served=counts.get("ok", 0),
        flood_refused=sum(refusals.values()),
        refusals=refusals,
    )


def slowdown(results: list[PhaseResult], of: str = "ttft_p50_s", phase: str = "") -> float:
    """The victim's median (`of`: TTFT or latency) in a phase (default the heaviest flood, the
    last flood phase) over its median alone (the alone phases' mean)."""
    alone = [getattr(r, of) for r in results if r.name.startswith("alone")]
    if phase:
        chosen = [getattr(r, of) for r in results if r.name == phase]
    else:
        chosen = [getattr(r, of) for r in results if r.name.startswith("flood")]
    if not chosen or not alone:
        return float("nan")
    return chosen[-1] / statistics.mean(alone)


def render(results: list[PhaseResult], info: dict[str, Any]) -> str:
    """The report as Markdown: what ran, a row per phase, the slowdowns and the shares."""
    lines = [
        f"Command: `{info['command']}`",
        "",
        f"Server: {info['server']}. Victim: {info['users']} user(s), {info['requests']} requests "
        f"a phase, {info['max_tokens']} tokens at most; flooder: {info['flood_users']} users "
        f"(a phase each), {info.get('flood_max_tokens', info['max_tokens'])} tokens at most, "
        f"sending as fast as they are let, a refused request again after "
        f"{info['flood_retry_s']:g} s. Client: {info['client']}.",
        "",
        "| phase | victim completed | victim TTFT p50 / p90 | victim latency p50 "
        "| flooder served | flooder refused |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.name == "shares":
            continue
        refused = ", ".join(f"{n} x {status}" for status, n in sorted(r.refusals.items()))
        lines.append(
            f"| {r.name} | {r.completed}/{r.requests} "
            f"| {r.ttft_p50_s * 1000:.0f} / {r.ttft_p90_s * 1000:.0f} ms "
            f"| {r.latency_p50_s:.2f} s | {r.flood_served} | {refused or '-'} |"
        )
    lines += [
        "",
        f"Victim's median under the heaviest flood: TTFT {slowdown(results):.2f}x alone, "
        f"latency {slowdown(results, 'latency_p50_s'):.2f}x.",
    ]
    if any(r.name == "priority" for r in results):
        urgent = slowdown(results, phase="priority")
        lines.append(f"Urgent requests beside a saturating batch: TTFT {urgent:.2f}x alone.")
    for r in results:
        if r.name == "shares":
            refused = ", ".join(f"{n} x {status}" for status, n in sorted(r.refusals.items()))
            lines.append(
                f"Both keys busy ({info.get('share_users')} users each, "
                f"{info.get('share_seconds')} s): victim {r.victim_tokens_per_s:.0f} tokens/s, "
                f"flooder {r.flood_tokens_per_s:.0f}: the victim's share {r.victim_share:.0%}"
                + (f" (the flooder refused {refused})." if refused else ".")
            )
    return "\n".join(lines) + "\n"


def save(folder: Path, results: list[PhaseResult], info: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"info": info, "phases": [asdict(r) for r in results], "slowdown": slowdown(results)}
    (folder / "fairness.json").write_text(json.dumps(data, indent=1))
    path = folder / "fairness.md"
    path.write_text("# Fairness between API keys\n\n" + render(results, info))
    lines = [f"{info['command']}", f"{info['server']}"]
    figures = fairness_figures(results)
    table = "<pre>" + html.escape(render(results, info)) + "</pre>"
    page = html_report.page("Fairness between API keys", lines, table, figures)
    (folder / "fairness.html").write_text(page)
    return path


def fairness_figures(results: list[PhaseResult]) -> list[html_report.Figure]:
    """The victim's times per phase, and the keys' shares while both are busy."""
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.name != "shares"]
    fig, (ttft, latency) = plt.subplots(1, 2, figsize=(12, 3.8))
    names = [r.name for r in timed]
    x = range(len(timed))
    ttft.bar([i - 0.2 for i in x], [r.ttft_p50_s * 1000 for r in timed], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [r.ttft_p90_s * 1000 for r in timed], 0.4, label="p90",
             hatch="//")  # fmt: skip
    latency.bar(list(x), [r.latency_p50_s for r in timed], 0.5)
    ttft.set_ylabel("victim TTFT (ms)")
    latency.set_ylabel("victim latency p50 (s)")
    for ax in (ttft, latency):
        ax.set_xticks(list(x), names, rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*ttft.get_legend_handles_labels(), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)  # fmt: skip
    caption = "The victim's time to first token (median, p90) and latency in each phase."
    out = [html_report.Figure("victim", "The victim's times by phase", caption,
                              html_report.svg(fig), 3 * len(timed))]  # fmt: skip
    shares = [r for r in results if r.name == "shares"]
    if shares:
        r = shares[0]
        fig, ax = plt.subplots(figsize=(7, 2.2))
        ax.barh([0], [r.victim_tokens_per_s], color="C0", label="victim")
        ax.barh([0], [r.flood_tokens_per_s], left=[r.victim_tokens_per_s], color="C1",
                hatch="//", label="flooder")  # fmt: skip
        ax.set_yticks([])
        ax.set_xlabel("generated tokens/s while both keys are busy")
        fig.legend(*ax.get_legend_handles_labels(), loc="upper center",
                   bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)  # fmt: skip
        caption = f"Each key's tokens per second; the victim's share {r.victim_share:.0%}."
        out.append(html_report.Figure("shares", "Shares while both keys are busy", caption,
                                      html_report.svg(fig), 2))  # fmt: skip
    return out


def write_docs(path: Path, results: list[PhaseResult], info: dict[str, Any]) -> None:
    """Replace (or append) the fairness section of a benchmarks page."""
    from tests.benchmarks.report import write_section

    body = f"## Fairness between API keys\n\n{render(results, info)}"
    write_section("fairness", body, path)
