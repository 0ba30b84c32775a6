"""`python -m load_tests fairness`: does one API key flooding a running server at its limits slow
another key down?

Two keys (`--victim-key`, `--flood-key`, or the first two lines of `--api-keys-file`). The victim
sends the workload's first `--requests` requests from `--users` users (closed loop) three times,
after a warm-up: alone, while the flooder's users send as fast as the server lets them (a phase
for each count in `--flood-users`; a refused request is sent again after `--flood-retry-s`: the
default ignores the server's Retry-After, as an abusive client would), and alone again. With as
many flood users as the flooder's `concurrency=` the flooder uses its allowance without being
refused: what sharing the server costs; more users add what refusing them costs. Per phase the
report gives the victim's median and p90 time to first token and median latency, and the
flooder's requests served and refused (429: its concurrency, request or token limits). The
victim's median TTFT under the heaviest flood over its median alone (both alone phases) is the
number to watch; the server's keys file decides how much the flooder may take (`concurrency=`,
`tokens_per_s=` on its line).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

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
    victim = HttpClient(args.url, sampling, victim_key)
    flooder = HttpClient(args.url, sampling, flood_key)
    phases: list[tuple[str, HttpClient | None, int]] = [("alone", None, 0)]
    for users in args.flood_users:
        phases.append((f"flood, {users} user{'s' if users > 1 else ''}", flooder, users))
    phases.append(("alone, after", None, 0))
    results = []
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
    finally:
        await victim.close()
        await flooder.close()
    info = {
        "command": command,
        "server": f"{model} at {args.url}",
        "users": args.users,
        "flood_users": args.flood_users,
        "flood_retry_s": args.flood_retry_s,
        "requests": len(items),
        "max_tokens": args.max_tokens,
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


def slowdown(results: list[PhaseResult]) -> float:
    """The victim's median TTFT under the heaviest flood (the last flood phase) over its
    median alone (the alone phases' mean)."""
    alone = [r.ttft_p50_s for r in results if r.flood_served + r.flood_refused == 0]
    flooded = [r.ttft_p50_s for r in results if r.flood_served + r.flood_refused > 0]
    return flooded[-1] / statistics.mean(alone)


def render(results: list[PhaseResult], info: dict[str, Any]) -> str:
    """The report as Markdown: what ran, a row per phase, the slowdown."""
    lines = [
        f"Command: `{info['command']}`",
        "",
        f"Server: {info['server']}. Victim: {info['users']} user(s), {info['requests']} requests "
        f"a phase, {info['max_tokens']} tokens at most; flooder: {info['flood_users']} users "
        f"(a phase each) sending as fast as they are let, a refused request again after "
        f"{info['flood_retry_s']:g} s. Client: {info['client']}.",
        "",
        "| phase | victim completed | victim TTFT p50 / p90 | victim latency p50 "
        "| flooder served | flooder refused |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        refused = ", ".join(f"{n} x {status}" for status, n in sorted(r.refusals.items()))
        lines.append(
            f"| {r.name} | {r.completed}/{r.requests} "
            f"| {r.ttft_p50_s * 1000:.0f} / {r.ttft_p90_s * 1000:.0f} ms "
            f"| {r.latency_p50_s:.2f} s | {r.flood_served} | {refused or '-'} |"
        )
    lines += [
        "",
        f"Victim's median TTFT under the heaviest flood: {slowdown(results):.2f}x alone.",
    ]
    return "\n".join(lines) + "\n"


def save(folder: Path, results: list[PhaseResult], info: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"info": info, "phases": [asdict(r) for r in results], "slowdown": slowdown(results)}
    (folder / "fairness.json").write_text(json.dumps(data, indent=1))
    path = folder / "fairness.md"
    path.write_text("# Fairness between API keys\n\n" + render(results, info))
    return path


def write_docs(path: Path, results: list[PhaseResult], info: dict[str, Any]) -> None:
    """Replace (or append) the fairness section of a benchmarks page."""
    from tests.benchmarks.report import write_section

    body = f"## Fairness between API keys\n\n{render(results, info)}"
    write_section("fairness", body, path)
