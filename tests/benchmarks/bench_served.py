"""What serving costs: the same requests into the engine itself, through its loop, through
`outrider serve` in-process and with the Ray runtime, and llama.cpp's llama-server beside them.

    python -m tests.benchmarks.bench_served [--levels 1 4 16 32] [--runs 3] [--no-cluster]
        [--cluster-args '--config pools.yaml'] [--peer llama-server] [--quick]

Every path gets the same greedy chat questions, `--max-tokens` tokens each with EOS ignored
(equal work), `c` at once, each new (`FreshQuestions`: no path has seen the question or its
subject before, as a user's next question is new; the chat template's start is shared, as it
is in chat; the servers of a round are asked the same questions, the in-process paths, which
share an engine, their own), in each path's
defaults (bf16 over the bundled GGUF's blocks; no speculation in one process; `make serve`'s
flags with the Ray runtime, n-gram drafts):

- **engine**: `LLMEngine.step` called in this process, nothing else running (`outrider
  generate`'s path), the outputs without their text;
- **engine loop**: `EngineLoop.stream` in this process: the loop thread, the hand-off of each
  step's outputs to the event loop, and the text made there;
- **serve**: `outrider serve` in its own process, streamed over HTTP by the load generator's
  client (server-sent events, as the OpenAI client reads them);
- **serve --cluster**: what `make serve` runs (its `SERVE_FLAGS`, read from the Makefile): the
  same with the engine in a Ray actor, beside a drafter and a prefill worker;
- **llama-server**: llama.cpp's server on the same GGUF, the same threads, `--parallel 32`
  (tests/benchmarks/llama_server.py; `--peer llama-server` builds it where it is missing).

Each round runs the in-process paths, then each server alone (started, warmed up with one
request, every level, stopped: as a user would run it, with no other server's processes on the
cores); a level asks `c` questions at once, again until it has asked `MIN_REQUESTS`; medians
over rounds. Per level: tokens/s of all requests, each path against the engine
and against llama-server, time to first token, and a stream's time per token after its first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kernels.openmp import release_thread_pool
from load_tests.clients import HttpClient, RequestRecord, Sampling, served_model
from load_tests.workload import WorkItem
from tests.benchmarks import llama_server
from tests.benchmarks.questions import distinct
from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section

ENGINE, LOOP, SERVE, CLUSTER, PEER = (
    "engine", "engine loop", "serve", "serve --cluster", "llama-server",
)  # fmt: skip
PORTS = {SERVE: 8301, CLUSTER: 8302, PEER: 8303}
# A level asks at least this many questions a round, `c` at a time (one stream: eight in turn),
# so that one answer's text (drafting speeds some up, by a fifth either way at one stream) does
# not make a round's figure
MIN_REQUESTS = 8


class FreshQuestions:
    """Chat questions no path of the run has been sent: a prompt seen before would time its
    prefix cache (a whole repeated prompt costs llama-server's slot one token) rather than the
    prefill a user's new question costs, and a subject asked before would be drafted from its
    last answer by `make serve`'s shared n-gram pool (tests/benchmarks/questions.py: any 72 in
    a row are on subjects of their own, more than a round asks a server). The in-process paths
    share one engine, so each is asked its own; the servers of a round, each started anew, are
    asked the same ones."""

    def __init__(self) -> None:
        self._next = 1000  # numbered: no prompt is another's

    def __call__(self, level: int) -> list[str]:
        first, self._next = self._next, self._next + level
        return [f"Question {first + i}: {q}" for i, q in enumerate(distinct(level, first))]


@dataclass(slots=True)
class Run:
    """One path at one level, one round: per request (first token s, last token s, tokens)."""

    wall: float = 0.0
    requests: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(n for _, _, n in self.requests) / self.wall

    @property
    def ttft(self) -> float:
        return statistics.median(first for first, _, _ in self.requests)

    @property
    def per_token(self) -> float:
        """A stream's seconds per token after its first (median over the requests)."""
        return statistics.median((last - first) / max(1, n - 1) for first, last, n in self.requests)


def batches(level: int) -> int:
    """How many times a round asks `level` questions at once (MIN_REQUESTS in all at least)."""
    return -(-MIN_REQUESTS // level)


def in_turn(runs: Sequence[Run]) -> Run:
    """Runs one after another as one: their walls added, their requests together."""
    return Run(sum(r.wall for r in runs), [q for r in runs for q in r.requests])


class Server:
    """A server in its own process, up once it lists its model."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{PORTS[name]}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.model = ""

    async def wait_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.log.name}")
                try:
                    self.model = await served_model(session, self.url)
                    return
                except (aiohttp.ClientError, RuntimeError, KeyError, IndexError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.name} not up in {timeout_s:.0f} s") from None
                    await asyncio.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the router drains, then stops its runtime
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def engine_run(engine: Any, prompts: Sequence[list[int]], params: Any) -> Run:
    """The requests added at once, the engine stepped by this thread until they finish."""
    from workers.engine.config import RequestSpec

    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"e{time.time_ns()}-{i}", ids, params, RequestSpec())
    seen: dict[str, list[float]] = {}  # request id -> [first, last, tokens]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter() - start
                mark = seen.setdefault(out.request_id, [now, now, 0])
                mark[1], mark[2] = now, mark[2] + len(out.new_token_ids)
    run = Run(time.perf_counter() - start)
    run.requests = [(a, b, int(n)) for a, b, n in seen.values()]
    return run


async def loop_run(loop: Any, prompts: Sequence[list[int]], params: Any) -> Run:
    start = time.perf_counter()

    async def one(i: int, ids: list[int]) -> tuple[float, float, int]:
        first = last = 0.0
        n = 0
        async for out in loop.stream(f"l{time.time_ns()}-{i}", ids, params):
            if out.new_token_ids:
                last = time.perf_counter() - start
                first = first or last
                n += len(out.new_token_ids)
        return first, last, n

    requests = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return Run(time.perf_counter() - start, list(requests))


async def http_run(server: Server, questions: Sequence[str], max_tokens: int) -> Run:
    sampling = Sampling(model=server.model, max_tokens=max_tokens, ignore_eos=True)
    client = HttpClient(server.url, sampling)
    records = [RequestRecord(level="", api="http", kind="chat", scheduled=0) for _ in questions]
    start = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                client.send(WorkItem("chat", messages=(("user", q),), index=i), records[i])
                for i, q in enumerate(questions)
            )
        )
    finally:
        await client.close()
    run = Run(time.perf_counter() - start)
    for record in records:
        if not record.ok or not record.chunks:
            raise RuntimeError(f"{server.name}: {record.status} {record.error}")
        # llama-server streams a chunk per token; ours may carry several tokens in one.
        n = record.output_tokens or len(record.chunks)
        run.requests.append((record.chunks[0], record.chunks[-1], n))
    return run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-cluster", action="store_true", help="leave out serve --cluster")
    parser.add_argument(
        "--cluster-args", default="", help="more flags for serve --cluster ('--config f.yaml')"
    )
    parser.add_argument("--peer", choices=["llama-server"], help="build the peer if missing")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench_served"))
    parser.add_argument("--quick", action="store_true", help="one round, 8 tokens, 1 and 2")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens, args.levels = 1, 8, [1, 2]
    return args


def make_serve_flags(makefile: Path = Path(__file__).parents[2] / "Makefile") -> list[str]:
    """The flags `make serve` gives `outrider serve` (its `SERVE_FLAGS`)."""
    match = re.search(r"^SERVE_FLAGS \?= (.+)$", makefile.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"no SERVE_FLAGS in {makefile}")
    return shlex.split(match.group(1))


def server_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server path's command line (llama-server where it is found or `--peer` builds it)."""
    from workers.model.loader import bundled_model_path

    outrider = [sys.executable, "-m", "router.cli", "serve", "--no-grpc"]
    commands = {SERVE: [*outrider, "--port", str(PORTS[SERVE]), "--threads", str(args.threads)]}
    if not args.no_cluster:
        more = shlex.split(args.cluster_args)
        # The verifier's threads as the others' where this host is the whole cluster (a config
        # file's pools, a cluster to join or a tensor-parallel group ask for their own CPUs, and
        # `outrider serve` refuses --threads with them).
        own = {"--config", "--address", "--tp"} & set(more)
        threads = [] if own else ["--threads", str(args.threads)]
        commands[CLUSTER] = [
            *outrider, "--port", str(PORTS[CLUSTER]), *make_serve_flags(), *threads, *more,
        ]  # fmt: skip
    binary = llama_server.find(build=args.peer is not None)
    if binary is not None:
        ctx = args.max_tokens + 256
        commands[PEER] = llama_server.command(
            binary, bundled_model_path(), PORTS[PEER], args.threads, max(args.levels), ctx
        )
    return commands


async def measure(args: argparse.Namespace) -> dict[tuple[str, int], Run]:
    """Each round: the in-process paths at every level, then each server, started alone (as a
    user would run it: no other server's processes on the cores), warmed up with one
    request, at every level, and stopped."""
    from router.cli import load
    from router.cli_args import build_parser
    from workers.engine.engine_loop import EngineLoop
    from workers.engine.sampling_params import SamplingParams

    loaded = load(build_parser().parse_args(["serve"]), progress=False)  # what serve builds
    engine, tok = loaded.engine, loaded.tokenizer
    # The engine path's outputs come without their text in every round, not only after the
    # first round's `EngineLoop` took the text off the engine (1 us a token: the detokenizer).
    engine.makes_text = False
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    commands = server_commands(args)
    args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], list[Run]] = {}

    def keep(name: str, level: int, run: Run) -> None:
        results.setdefault((name, level), []).append(run)
        print(f"c={level} {name}: {run.tokens_per_s:.0f} tok/s", flush=True)

    fresh = FreshQuestions()

    def prompts_for(level: int) -> list[list[int]]:
        return [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            for q in fresh(level)
        ]

    for round_ in range(args.runs):
        print(f"round {round_ + 1} of {args.runs}", flush=True)
        for level in args.levels:
            # Each thread that takes the model over starts its OpenMP workers with a short
            # request first.
            engine_run(engine, prompts_for(1), warm)
            runs = [engine_run(engine, prompts_for(level), params) for _ in range(batches(level))]
            keep(ENGINE, level, in_turn(runs))
            # The loop thread alone steps the model: this one hands its workers back, and the
            # loop's go when it ends (kernels/openmp.py).
            release_thread_pool()
            loop = EngineLoop(engine)
            await loop_run(loop, prompts_for(1), warm)
            runs = [await loop_run(loop, prompts_for(level), params) for _ in range(batches(level))]
            keep(LOOP, level, in_turn(runs))
            loop.close()
        # Every server of the round is asked the same new questions (each its own process and
        # caches): a drafting server's speed depends on the text it answers.
        warm_up = fresh(1)
        asked = {level: [fresh(level) for _ in range(batches(level))] for level in args.levels}
        for name, command in commands.items():
            server = Server(name, command, args.logs / f"{name.replace(' ', '')}.log")
            try:
                await server.wait_up(timeout_s=300)
                await http_run(server, warm_up, 2)
                for level in args.levels:
                    runs = [await http_run(server, q, args.max_tokens) for q in asked[level]]
                    keep(name, level, in_turn(runs))
            finally:
                server.stop()
    return {key: median_run(runs) for key, runs in results.items()}


def median_run(runs: list[Run]) -> Run:
    """The round whose tokens/s is the median."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def render(args: argparse.Namespace, runs: dict[tuple[str, int], Run], paths: list[str]) -> str:
    rows = []
    for level in args.levels:
        base = runs[(ENGINE, level)]
        peer = runs.get((PEER, level))
        for path in paths:
            run = runs[(path, level)]
            rows.append([
                str(level),
                path,
                f"{run.tokens_per_s:.0f}",
                f"{run.tokens_per_s / base.tokens_per_s:.2f}x",
                f"{run.tokens_per_s / peer.tokens_per_s:.2f}x" if peer else "-",
                f"{run.ttft * 1e3:.0f} ms",
                f"{run.per_token * 1e3:.1f} ms",
            ])  # fmt: skip
    header = [
        "c", "path", "tokens/s", "of the engine", "of llama-server", "TTFT p50",
        "per token (a stream)",
    ]  # fmt: skip
    one = min(args.levels)
    steps = [
        f"{path}: {runs[(path, one)].per_token * 1e3:.1f} ms" for path in paths if path != PEER
    ]
    return (
        "## Served against the engine (`python -m tests.benchmarks.bench_served`)\n\n"
        f"Command: `{' '.join(['python -m tests.benchmarks.bench_served', *sys.argv[1:]])}`. "
        f"Machine: {machine_line()}, {os.cpu_count()} CPUs. "
        f"Greedy chat questions of {args.max_tokens} tokens with EOS ignored, `c` at once, "
        f"again until a level has asked {MIN_REQUESTS}, each new (no path was sent it or, in a "
        "round, its subject before; every server of a round the same ones), "
        "each path's defaults (bf16 over the GGUF's blocks; no speculation in one process; "
        f"`make serve`'s flags with the Ray runtime: `{shlex.join(make_serve_flags())}`); "
        f"the median of {args.runs} "
        "rounds, each running the in-process paths and then each server alone. "
        "llama-server: the same GGUF and threads, `--parallel` the largest `c`.\n\n"
        + table(header, rows)
        + f"\n\nA stream's time per token at c = {one}: "
        + "; ".join(steps)
        + ".\n"
    )


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    runs = asyncio.run(measure(args))
    paths = [ENGINE, LOOP, *(p for p in (SERVE, CLUSTER, PEER) if (p, args.levels[0]) in runs)]
    body = render(args, runs, paths)
    print(body)
    write_section("bench_served", body, args.output)


if __name__ == "__main__":
    main()
