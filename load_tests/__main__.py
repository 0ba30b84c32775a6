"""`python -m load_tests run|report`: see the package's docstring and docs/operations.md."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tqdm import tqdm

from load_tests import partitions, report
from load_tests.clients import Client, GrpcClient, HttpClient, Sampling, served_model
from load_tests.report import REPORTS, client_line
from load_tests.runner import Level, measure_level
from load_tests.server_metrics import MetricsPoller
from load_tests.workload import DEFAULT_WORKLOAD, RandomWorkload, Workload, load_workload

CHAOS_PARTS = ("drafter", "verifier", "rank", "prefill", "redis")
READY_TIMEOUT_S = 300.0


def _numbers(kind: Callable[[str], float]) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers: {text!r}"
            ) from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive numbers: {text!r}")
        return values

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load_tests", description=__doc__)
    commands = p.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="send load levels to a running server")
    target = run.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP URL")
    target.add_argument("--api", choices=("http", "grpc"), default="http")
    target.add_argument("--grpc-target", help="host:port of the gRPC API (default: URL host:50051)")
    keys = target.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key", default=os.environ.get("OUTRIDER_API_KEY"), help="($OUTRIDER_API_KEY)"
    )
    keys.add_argument(
        "--api-keys-file", type=Path, help="use the first key of a router's API keys file"
    )
    target.add_argument("--model", help="model name to ask for (default: the served one)")
    target.add_argument(
        "--metrics-url",
        action="append",
        help="a router replica's /metrics, repeatable (default: URL/metrics; 'none': skip)",
    )
    target.add_argument("--metrics-interval", type=float, default=1.0, help="seconds")
    load = run.add_argument_group("load")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency", type=_numbers(int), help="closed loop: users per level, e.g. 1,2,4"
    )
    shape.add_argument("--rate", type=_numbers(float), help="open loop: Poisson req/s per level")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop: gamma arrivals of this shape (1: Poisson; below 1: burstier)",
    )
    load.add_argument(
        "--requests", type=int, help="requests per level (default max(16, 4 x users); rate: 16)"
    )
    load.add_argument(
        "--turns", type=int, default=1, help="a chat continues for up to this many turns"
    )
    load.add_argument("--warmup", type=int, default=2, help="unrecorded requests first")
    load.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="JSONL requests")
    load.add_argument(
        "--random-input-len",
        type=int,
        metavar="N",
        help="instead of the workload: prompts of N random token ids (with --random-output-len)",
    )
    load.add_argument("--random-output-len", type=int, metavar="N", help="tokens per request")
    load.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths drawn within this fraction of the means",
    )
    load.add_argument("--seed", type=int, default=0, help="workload order and arrival times")
    req = run.add_argument_group("each request")
    req.add_argument("--max-tokens", type=int, default=128)
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--sampling-seed", type=int, help="the requests' `seed` field")
    req.add_argument("--ignore-eos", action="store_true", help="always generate max tokens")
    req.add_argument("--no-speculation", action="store_true")
    req.add_argument("--spec-method", help="per-request speculative method")
    req.add_argument("--num-spec-tokens", type=int)
    req.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    out = run.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT bound")
    out.add_argument("--slo-tpot-ms", type=float, help="goodput: time per output token bound")
    out.add_argument("--title")
    out.add_argument(
        "--max-refused",
        type=int,
        help="exit with status 1 when more requests than this did not succeed (a smoke test)",
    )
    out.add_argument("--out", type=Path, help=f"folder (default {REPORTS}/<time>)")
    chaos = commands.add_parser(
        "chaos",
        help="kill parts of a running `outrider serve --cluster` under load; report what the "
        "clients lost",
    )
    chaos.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP URL")
    chaos.add_argument("--api-key", default=os.environ.get("OUTRIDER_API_KEY"))
    chaos.add_argument("--address", default="auto", help="the Ray cluster the server runs on")
    chaos.add_argument("--redis-url", help="the server's Redis (for the redis fault)")
    chaos.add_argument(
        "--faults",
        default=",".join(CHAOS_PARTS),
        help=f"parts to kill, comma-separated, from {','.join(CHAOS_PARTS)}",
    )
    chaos.add_argument("--users", type=int, default=16, help="concurrent streams")
    chaos.add_argument("--requests", type=int, default=32, help="requests a phase")
    chaos.add_argument("--max-tokens", type=int, default=64)
    chaos.add_argument("--kill-after", type=float, default=3.0, help="seconds into a phase")
    chaos.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    chaos.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    chaos.add_argument("--out", type=Path, help=f"folder (default {REPORTS}/chaos-<time>)")
    chaos.add_argument(
        "--docs", type=Path, help="also write the table into this benchmarks page's chaos section"
    )
    partitions.add_parser(commands)
    fair = commands.add_parser(
        "fairness",
        help="one API key floods a running server at its limits: how much slower is another's "
        "time to first token",
    )
    fair.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP URL")
    fair.add_argument("--victim-key", help="the key whose requests are timed")
    fair.add_argument("--flood-key", help="the key that floods")
    fair.add_argument(
        "--api-keys-file", type=Path, help="else: the first two keys of this file (victim, flood)"
    )
    fair.add_argument("--users", type=int, default=1, help="the victim's concurrent users")
    fair.add_argument(
        "--flood-users",
        type=_numbers(int),
        default=[32],
        help="the flooder's users, a phase for each (comma-separated)",
    )
    fair.add_argument("--flood-max-tokens", type=int, default=64, help="each flood request's")
    fair.add_argument(
        "--batch-priority",
        type=int,
        default=10,
        help="the flooder's priority in the priority phase (lower first; the victim's is 0)",
    )
    fair.add_argument(
        "--share-users", type=int, default=16, help="each key's users in the shares phase (0: none)"
    )
    fair.add_argument("--share-seconds", type=float, default=30.0, help="the shares phase's length")
    fair.add_argument(
        "--flood-retry-s",
        type=float,
        default=0.05,
        help="a refused flood request is sent again this long after (1: as Retry-After says)",
    )
    fair.add_argument("--requests", type=int, default=12, help="the victim's requests a phase")
    fair.add_argument("--max-tokens", type=int, default=32)
    fair.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    fair.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    fair.add_argument("--out", type=Path, help=f"folder (default {REPORTS}/fairness-<time>)")
    fair.add_argument(
        "--docs", type=Path, help="also write the table into this benchmarks page's section"
    )
    rep = commands.add_parser("report", help="rebuild report.md and report.html from run folders")
    rep.add_argument("folders", type=Path, nargs="+")
    rep.add_argument(
        "--compare",
        type=Path,
        help="also write the runs side by side here (Markdown), and their figures overlaid "
        "beside it (the same name ending .html)",
    )
    return p


def levels_from(args: argparse.Namespace) -> list[Level]:
    if args.metrics_interval <= 0 or args.warmup < 0:
        raise ValueError("--metrics-interval must be positive and --warmup not negative")
    if args.rate:
        count = 16 if args.requests is None else args.requests
        return [
            Level(
                count,
                rate=r,
                max_concurrency=args.max_concurrency,
                turns=args.turns,
                burstiness=args.burstiness,
            )
            for r in args.rate
        ]
    if args.max_concurrency is not None or args.burstiness != 1.0:
        raise ValueError("--max-concurrency and --burstiness apply to --rate levels")
    users = args.concurrency or [1, 2, 4]
    count = args.requests
    return [
        Level(max(16, 4 * c) if count is None else count, concurrency=c, turns=args.turns)
        for c in users
    ]


def first_key(path: Path) -> str:
    """The first key of an API keys file, in the router's format."""
    from router.keys import read_keys_file

    keys = read_keys_file(path)
    if not keys:
        raise ValueError(f"{path}: no API keys")
    return keys[0].key


async def run(args: argparse.Namespace, command: str) -> tuple[Path, report.Run]:
    if args.api_keys_file is not None:
        args.api_key = first_key(args.api_keys_file)
    levels = levels_from(args)
    workload = workload_from(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        try:
            model = args.model or await served_model(session, args.url)
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"no server at {args.url}: {exc}") from None
        sampling = Sampling(
            model=model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
            speculation=not args.no_speculation,
            spec_method=args.spec_method,
            num_spec_tokens=args.num_spec_tokens,
            timeout_s=args.timeout,
        )
        client = make_client(args, sampling)
        metrics_urls = args.metrics_url or [args.url.rstrip("/") + "/metrics"]
        watch = metrics_urls != ["none"]
        folder = args.out or REPORTS / time.strftime("%Y%m%d-%H%M%S")
        result = report.Run(
            info=run_info(args, command, model, workload, sampling),
            levels=[],
            records=[],
            servers={},
        )
        items = workload.stream(args.seed)
        try:
            if args.warmup:
                print(f"warm-up: {args.warmup} requests", flush=True)
                await measure_level(client, Level(args.warmup, concurrency=1), items)
            for number, level in enumerate(levels):
                print(f"level {level.name}: {level.num_requests} requests", flush=True)
                poller = MetricsPoller(session, metrics_urls, args.metrics_interval)
                # A bar on a terminal (none in a log): conversations of the level done.
                with tqdm(
                    total=level.num_requests, desc=level.name, unit="req", disable=None
                ) as bar:
                    records, view = await measure_level(
                        client,
                        level,
                        items,
                        poller if watch else None,
                        args.seed + number,
                        bar.update,
                    )
                result.levels.append(level.name)
                result.records += records
                result.servers[level.name] = view
                report.save(folder, result)  # after every level: a stopped run keeps its levels
        finally:
            await client.close()
    print(report.client_table(result.summaries(), result.slo))
    return folder, result


def workload_from(args: argparse.Namespace) -> Workload | RandomWorkload:
    lengths = (args.random_input_len, args.random_output_len)
    if lengths == (None, None):
        return load_workload(args.workload)
    if None in lengths:
        raise ValueError("--random-input-len and --random-output-len go together")
    if args.workload != DEFAULT_WORKLOAD:
        raise ValueError("--workload or random lengths, not both")
    return RandomWorkload(args.random_input_len, args.random_output_len, args.random_range_ratio)


def run_info(
    args: argparse.Namespace,
    command: str,
    model: str,
    workload: Workload | RandomWorkload,
    sampling: Sampling,
) -> dict[str, Any]:
    """What a report says about its run."""
    return {
        "title": args.title,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "url": args.url,
        "api": args.api,
        "model": model,
        "workload": workload.describe(_shown(args.workload)),
        "seed": args.seed,
        "sampling": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "ignore_eos": sampling.ignore_eos,
            "speculation": sampling.speculation,
            "spec_method": sampling.spec_method,
            "num_spec_tokens": sampling.num_spec_tokens,
        },
        "slo": {
            "ttft_s": None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
            "tpot_s": None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000,
        },
        "client": client_line(),
    }


def _shown(path: Path) -> str:
    """A path as a report shows it: from the repository's root when it lies inside."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def make_client(args: argparse.Namespace, sampling: Sampling) -> Client:
    if args.api == "grpc":
        target = args.grpc_target or f"{urlsplit(args.url).hostname}:50051"
        return GrpcClient(target, sampling, args.api_key)
    return HttpClient(args.url, sampling, args.api_key)


async def chaos(args: argparse.Namespace, command: str) -> Path:
    import ray

    from load_tests import chaos as chaos_test

    parts = [p.strip() for p in args.faults.split(",") if p.strip()]
    if unknown := set(parts) - set(CHAOS_PARTS):
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {CHAOS_PARTS}")
    ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    faults = chaos_test.ray_faults(p for p in parts if p != "redis")
    if "redis" in parts:
        if args.redis_url is None:
            raise ValueError("the redis fault needs --redis-url")
        faults["redis"] = chaos_test.redis_fault(args.redis_url)
    missing = [p for p in parts if p not in faults]
    items = list(itertools.islice(load_workload(args.workload).stream(0), args.requests))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        model = await served_model(session, args.url)
        sampling = Sampling(
            model=model, max_tokens=args.max_tokens, ignore_eos=True, timeout_s=args.timeout
        )
        client = HttpClient(args.url, sampling, args.api_key)
        phases: list[tuple[str, list[chaos_test.Fault]]] = [("no fault", [])]
        phases += [(f"kill {name}", [fault]) for name, fault in faults.items()]
        if len(faults) > 1:
            phases.append(("kill all at once", list(faults.values())))
        phases.append(("no fault, after", []))
        results, expected = [], None
        try:
            for name, killed in phases:
                await _until_ready(session, args.url)
                print(f"phase {name}: {len(items)} requests, {args.users} users", flush=True)
                result, outputs, _ = await chaos_test.run_phase(
                    name,
                    client,
                    items,
                    args.users,
                    killed,
                    args.kill_after,
                    expected,
                    lambda: _is_ready(session, args.url),
                )
                expected = expected or outputs
                results.append(result)
        finally:
            await client.close()
    info = {
        "command": command,
        "server": f"{model} at {args.url}, actors killed by name on its Ray cluster"
        + (f" (not deployed: {', '.join(missing)})" if missing else ""),
        "users": args.users,
        "requests": len(items),
        "max_tokens": args.max_tokens,
        "kill_after_s": args.kill_after,
        "client": client_line(),
    }
    folder = args.out or REPORTS / time.strftime("chaos-%Y%m%d-%H%M%S")
    path = chaos_test.save(folder, results, info)
    print(chaos_test.render(results, info))
    if args.docs is not None:
        chaos_test.write_docs(args.docs, results, info)
        print(f"wrote the chaos section of {args.docs}")
    return path


async def _is_ready(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether the router says every part is up (Redis included)."""
    try:
        async with session.get(url.rstrip("/") + "/ready") as resp:
            return resp.status == 200 and (await resp.json()).get("status") == "ready"
    except aiohttp.ClientError:
        return False


async def _until_ready(session: aiohttp.ClientSession, url: str) -> None:
    """Wait until the router says every part is back (after a phase's faults)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if await _is_ready(session, url):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {READY_TIMEOUT_S:g} s")


def rebuild(folders: list[Path], compare: Path | None) -> None:
    runs = []
    for folder in folders:
        loaded = report.load(folder)
        (folder / report.REPORT).write_text(report.render(loaded))
        (folder / report.HTML_REPORT).write_text(report.render_html(loaded, folder.name))
        print(f"wrote {folder / report.REPORT} and {report.HTML_REPORT}")
        runs.append((loaded.info.get("title") or folder.name, loaded))
    if compare is not None:
        compare.write_text(report.compare(runs))
        figures = compare.with_suffix(".html")
        figures.write_text(report.compare_html(runs))
        print(f"wrote {compare} and {figures}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "report":
            rebuild(args.folders, args.compare)
            return 0
        command = "python -m load_tests " + shlex.join(sys.argv[1:] if argv is None else argv)
        if args.command == "chaos":
            print(f"report: {asyncio.run(chaos(args, command))}")
            return 0
        if args.command == "partitions":
            print(f"report: {partitions.run(args, command)}")
            return 0
        if args.command == "fairness":
            from load_tests.fairness import run_fairness

            print(f"report: {asyncio.run(run_fairness(args, command))}")
            return 0
        folder, result = asyncio.run(run(args, command))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {folder / report.REPORT}")
    failed = sum(not record.ok for record in result.records)
    if args.max_refused is not None and failed > args.max_refused:
        print(f"{failed} requests did not succeed (at most {args.max_refused} allowed)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
