"""`python -m load_tests partitions` (root): the chaos load test across separate network hosts.

It starts the multi-host test bed (tests/hosts/bed.py): router, Redis, Ray head, two verifier
nodes (`gpu`, `gpu2`), a drafter node (`cpu`) and a prefill node (`prefill`), each a network
namespace of its own, the load generator on a `client` host. Each phase sends the same greedy
streams and injects one network fault:

- `cpu`, `redis`, `gpu`: that host cut off (`ip link set ... down`: packets dropped, no socket
  closed) `--at` seconds into the phase for `--down` seconds, then mended. `gpu` is one of the
  two verifier nodes, so a healthy group remains.
- `slow-link`: every packet between `prefill` and the verifier nodes held `--delay` and lost
  with probability `--loss`, each way, for the whole phase (tests/hosts/relay.py).

A phase with no fault first gives the texts every other phase is compared with; one after the
faults shows the cluster whole again. The report is the chaos report (load_tests/chaos.py):
requests completed and failed, outputs differing, the longest pause between streamed pieces and
the time to first token, a row a phase.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from load_tests import chaos
from load_tests.clients import RequestRecord
from load_tests.report import REPORTS, client_line

FAULTS = ("cpu", "redis", "gpu", "slow-link")
TITLE = "Partitions across hosts"
PHASE_NAMES = {
    "cpu": "cut the drafter host",
    "redis": "cut the Redis host",
    "gpu": "cut a verifier host",
    "slow-link": "slow, lossy prefill-verifier link",
}


def add_parser(commands: Any) -> None:
    """The `partitions` subcommand's arguments."""
    parts = commands.add_parser(
        "partitions",
        help="cut hosts off and slow a link of a cluster spread over network namespaces "
        "(root); report what the clients lost",
    )
    parts.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated, from {','.join(FAULTS)}"
    )
    parts.add_argument("--users", type=int, default=16, help="concurrent streams")
    parts.add_argument("--requests", type=int, default=48, help="requests a phase")
    parts.add_argument("--max-tokens", type=int, default=48)
    parts.add_argument("--at", type=float, default=6.0, help="seconds into a phase to cut")
    parts.add_argument("--down", type=float, default=10.0, help="seconds a host is cut off")
    parts.add_argument("--delay", type=float, default=0.05, help="slow link: seconds each way")
    parts.add_argument("--loss", type=float, default=0.05, help="slow link: packets lost")
    parts.add_argument("--out", type=Path, help=f"folder (default {REPORTS}/partitions-<time>)")
    parts.add_argument(
        "--docs", type=Path, help="also write the table into this benchmarks page's section"
    )


def run(args: argparse.Namespace, command: str) -> Path:
    from tests.cluster.common import TEXTS
    from tests.hosts.bed import Bed, Partition
    from tests.hosts.netns import unavailable

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := set(faults) - set(FAULTS):
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    if (why := unavailable()) is not None:
        raise RuntimeError(f"cannot make the test bed's hosts: {why}")
    prompts = [*TEXTS, "Three things to pack for a day in the mountains:"]
    results: list[chaos.PhaseResult] = []
    with Bed(verifier_hosts=2, prefill_host=True) as bed:
        print(f"starting the test bed in {bed.workdir}", flush=True)
        bed.start()
        expected: list[str] | None = None
        for fault in ["", *faults, ""]:
            name = PHASE_NAMES.get(fault) or ("no fault, after" if expected else "no fault")
            print(f"phase {name}: {args.requests} requests, {args.users} users", flush=True)
            partition = None
            if fault in ("cpu", "redis", "gpu"):
                partition = Partition(bed.network, fault, args.at, args.down)
            elif fault == "slow-link":
                bed.network.impair("prefill", bed.verifier_hosts, args.delay, args.loss)
            wired = bed.network.wire_counts("prefill")
            try:
                load = bed.load(prompts, args.requests, args.users, args.max_tokens, partition)
            finally:
                if partition is not None:
                    partition.mend()
                bed.network.repair()
            records = [RequestRecord.from_json(row["record"]) for row in load.rows]
            outputs = [row["text"] or "" for row in load.rows]
            result = chaos.summarize(name, records, outputs, expected, {})
            results.append(result)
            time.sleep(0.5)  # the relay writes its counts every quarter second
            counts = bed.network.wire_counts("prefill")
            moved = {k: v - wired.get(k, 0) for k, v in counts.items()}
            print(
                f"  completed {result.completed} of {result.requests}, "
                f"{result.differing} differing, longest pause {result.max_pause_s:.1f} s, "
                f"TTFT p50 {result.ttft_p50_s * 1000:.0f} ms; the prefill host's packets: "
                f"{moved.get('held', 0)} held, {moved.get('dropped', 0)} dropped, "
                f"{moved.get('copied', 0)} passed",
                flush=True,
            )
            expected = expected or outputs
            time.sleep(2.0)  # a mended host's links settle before the next phase
    info = _info(args, command)
    folder = args.out or REPORTS / time.strftime("partitions-%Y%m%d-%H%M%S")
    path = chaos.save(folder, results, info, TITLE)
    print(chaos.render(results, info))
    if args.docs is not None:
        chaos.write_docs(args.docs, results, info, "partitions", TITLE)
        print(f"wrote the partitions section of {args.docs}")
    return path


def _info(args: argparse.Namespace, command: str) -> dict[str, Any]:
    return {
        "command": command,
        "server": "the multi-host test bed (tests/hosts/bed.py): fp32 EAGLE, every prompt "
        "prefilled on the prefill node, two verifier groups on two nodes",
        "users": args.users,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "faults": f"at most {args.max_tokens} tokens each; a host cut {args.at:g} s into its "
        f"phase for {args.down:g} s; the slow link {args.delay * 1000:g} ms each way with "
        f"{args.loss:.0%} of packets lost",
        "client": client_line(),
    }
