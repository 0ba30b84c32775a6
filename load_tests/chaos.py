"""`python -m load_tests chaos`: a load of concurrent greedy streams against a running
`outrider serve --cluster` while its parts are killed, one at a time and then together.

Phases, each the same requests (the workload's first ones, greedy, `ignore_eos`) from the same
number of users:

1. no fault: the outputs every other phase is compared with;
2. one phase per fault, the fault injected `--kill-after` seconds in (mid-stream):
   a drafter actor, the verifier rank 0, a tensor-parallel rank, the prefill worker (each
   killed with `ray.kill`, which Ray restarts), the Redis server (`SHUTDOWN NOSAVE`: the embedded
   one is started again by its watcher, an external one by whatever supervises it);
3. all of them at once;
4. no fault again.

Per phase the report gives requests accepted (their stream started), completed and failed;
outputs that differ from the fault-free run's, with the characters lost or repeated; the
longest pause a client saw (its largest gap between streamed pieces, against the fault-free
run's); how long each killed part took to answer again, and the server to say it is ready. The
tool joins the Ray cluster the server runs on (it finds the actors by name) and needs
`--redis-url` for the Redis fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from load_tests.clients import Client, RequestRecord
from load_tests.stats import inter_chunk_gaps, percentile
from load_tests.workload import WorkItem

RECOVERY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Fault:
    """A part of the deployment to kill: `kill` does it, `back` says whether it answers again
    (as a new process: a restarted actor's pid differs)."""

    name: str
    kill: Callable[[], None]
    back: Callable[[], bool]


@dataclass(slots=True)
class PhaseResult:
    name: str
    requests: int
    accepted: int  # streams that started (a 200)
    completed: int
    failed: int
    differing: int  # completed outputs that differ from the fault-free run's
    chars_lost: int
    chars_repeated: int
    max_pause_s: float  # the longest gap between streamed pieces any client saw
    p99_pause_s: float  # over the requests' own longest gaps
    ttft_p50_s: float = 0.0  # time to first token over the requests that streamed
    ttft_max_s: float = 0.0
    recovery_s: dict[str, float | None] = field(default_factory=dict)  # per part killed
    errors: list[str] = field(default_factory=list)


def ray_faults(parts: Iterable[str]) -> dict[str, Fault]:
    """Faults for the named Outrider actors found on the Ray cluster this process joined:
    `drafter` (the first drafter), `verifier` (group 0's rank 0), `rank` (group 0's rank 1),
    `prefill` (the first prefill worker); parts the deployment lacks are left out."""
    import ray
    from ray.util import list_named_actors

    from cluster.actors import RAY_NAMESPACE

    listed = list_named_actors(all_namespaces=True)
    names = {a["name"] for a in listed if a.get("namespace") == RAY_NAMESPACE}
    wanted = {
        "drafter": "drafter-0",
        "verifier": "verifier-g0-r0",
        "rank": "verifier-g0-r1",
        "prefill": "prefill-0",
    }
    faults = {}
    for part in parts:
        name = wanted[part]
        if name not in names:
            continue
        actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
        faults[part] = _actor_fault(part, actor)
    return faults


def _actor_fault(part: str, actor: Any) -> Fault:
    import ray

    before: list[int] = []

    def pid() -> int | None:
        try:
            return int(ray.get(actor.info.remote(), timeout=5)["pid"])
        except Exception:
            return None

    def kill() -> None:
        old = pid()
        before[:] = [] if old is None else [old]
        ray.kill(actor, no_restart=False)

    def back() -> bool:
        now = pid()
        return now is not None and now not in before

    return Fault(part, kill, back)


def redis_fault(url: str) -> Fault:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def kill() -> None:
        with contextlib.suppress(redis.ConnectionError):  # it hangs up as it goes
            client.shutdown(nosave=True)

    def back() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    return Fault("redis", kill, back)


async def run_phase(
    name: str,
    client: Client,
    items: list[WorkItem],
    users: int,
    faults: list[Fault],
    kill_after_s: float,
    expected: list[str] | None,
    ready: Callable[[], Awaitable[bool]] | None = None,
) -> tuple[PhaseResult, list[str], list[RequestRecord]]:
    """One phase: `users` streams at a time over `items`, `faults` injected together
    `kill_after_s` in; the result, the outputs and the records. With `ready` (whether the
    server says every part is up), how long after the faults it said so again."""
    records = [RequestRecord(name, client.api, item.kind, 0.0, item=item.index) for item in items]
    outputs = [""] * len(items)
    pending = iter(range(len(items)))
    t0 = time.perf_counter()

    async def user() -> None:
        for i in pending:
            records[i].start = time.perf_counter() - t0
            outputs[i] = await client.send(items[i], records[i])

    async def inject() -> dict[str, float | None]:
        await asyncio.sleep(kill_after_s)
        killed_at = time.monotonic()
        loop = asyncio.get_running_loop()
        for fault in faults:
            await loop.run_in_executor(None, fault.kill)
        checks: dict[str, Callable[[], Awaitable[bool]]] = {
            fault.name: partial(loop.run_in_executor, None, fault.back) for fault in faults
        }
        if ready is not None:
            checks["ready"] = ready
        waits = [_time_until(check, killed_at) for check in checks.values()]
        return dict(zip(checks, await asyncio.gather(*waits), strict=True))

    injector = asyncio.ensure_future(inject()) if faults else None
    await asyncio.gather(*(user() for _ in range(users)))
    recovery = await injector if injector is not None else {}
    return summarize(name, records, outputs, expected, recovery), outputs, records


async def _time_until(check: Callable[[], Awaitable[bool]], since: float) -> float | None:
    """Seconds from `since` until `check` says yes (None: not within the recovery timeout)."""
    await asyncio.sleep(0.5)  # the server's own view of a part lags the kill a little
    while time.monotonic() - since < RECOVERY_TIMEOUT_S:
        if await check():
            return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


def summarize(
    name: str,
    records: list[RequestRecord],
    outputs: list[str],
    expected: list[str] | None,
    recovery: dict[str, float | None],
) -> PhaseResult:
    pauses = [max(inter_chunk_gaps(r), default=0.0) for r in records if r.ok]
    ttfts = [r.ttft for r in records if r.ttft is not None]
    lost = repeated = differing = 0
    for record, got, want in zip(records, outputs, expected or outputs, strict=True):
        if not record.ok or got == want:
            continue
        differing += 1
        for tag, a0, a1, b0, b1 in difflib.SequenceMatcher(None, want, got).get_opcodes():
            if tag in ("delete", "replace"):
                lost += a1 - a0
            if tag in ("insert", "replace"):
                repeated += b1 - b0
    return PhaseResult(
        name=name,
        requests=len(records),
        # Refused: an HTTP status before the stream, or no connection at all.
        accepted=sum(not (r.status.isdigit() or r.status == "connection") for r in records),
        completed=sum(r.ok for r in records),
        failed=sum(not r.ok for r in records),
        differing=differing,
        chars_lost=lost,
        chars_repeated=repeated,
        max_pause_s=max(pauses, default=0.0),
        p99_pause_s=percentile(pauses, 99) if pauses else 0.0,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else 0.0,
        ttft_max_s=max(ttfts, default=0.0),
        recovery_s=recovery,
        errors=sorted({f"{r.status}: {r.error}" for r in records if not r.ok})[:5],
    )


def render(results: list[PhaseResult], info: dict[str, Any]) -> str:
    """The report as Markdown: what ran, then a row per phase."""
    lines = [
        f"Command: `{info['command']}`",
        "",
        f"Server: {info['server']}. Load: {info['users']} concurrent greedy streams, "
        f"{info['requests']} requests a phase, "
        + (
            info["faults"]
            if "faults" in info
            else f"{info['max_tokens']} tokens each (`ignore_eos`), faults injected "
            f"{info['kill_after_s']:g} s into a phase"
        )
        + f". Client: {info['client']}.",
        "",
        "| phase | accepted | completed | failed | outputs differing (chars lost / repeated) "
        "| longest pause (p99 of requests') | TTFT p50 (max) "
        "| back after (ready: the server's /ready) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        back = ", ".join(
            f"{part} {'never' if s is None else f'{s:.1f} s'}" for part, s in r.recovery_s.items()
        )
        lines.append(
            f"| {r.name} | {r.accepted}/{r.requests} | {r.completed} | {r.failed} "
            f"| {r.differing} ({r.chars_lost} / {r.chars_repeated}) "
            f"| {r.max_pause_s:.2f} s ({r.p99_pause_s:.2f} s) "
            f"| {r.ttft_p50_s * 1000:.0f} ms ({r.ttft_max_s:.2f} s) | {back or '-'} |"
        )
    failures = [f"- {r.name}: {e}" for r in results for e in r.errors]
    if failures:
        lines += ["", "Failures seen:", *failures]
    return "\n".join(lines) + "\n"


def save(
    folder: Path, results: list[PhaseResult], info: dict[str, Any], title: str = "Chaos load test"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"info": info, "phases": [asdict(r) for r in results]}
    (folder / "chaos.json").write_text(json.dumps(data, indent=1))
    path = folder / "chaos.md"
    path.write_text(f"# {title}\n\n" + render(results, info))
    return path


def write_docs(
    path: Path,
    results: list[PhaseResult],
    info: dict[str, Any],
    section: str = "chaos",
    title: str = "Chaos load test",
) -> None:
    """Replace (or append) a section of a benchmarks page with the report."""
    from tests.benchmarks.report import write_section

    write_section(section, f"## {title}\n\n{render(results, info)}", path)
