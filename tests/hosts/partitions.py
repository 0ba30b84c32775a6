"""`python -m tests.hosts.partitions`: cut hosts of the multi-host test bed off mid-load, one at
a time, and print what the clients saw (root; the numbers in docs/benchmarks.md, "Partitions
across hosts").

The bed (tests/hosts/bed.py) runs with two verifier nodes, so a verifier host cut off leaves a
healthy group. For each host named: a load of greedy streams from the client host, the host cut
off (`ip link set ... down`: packets dropped, nothing closed) `--at` seconds in for `--down`
seconds, then mended, then a calm load to see the system whole again. Each text is compared
with the same prompt's text from a calm load before any cut."""

from __future__ import annotations

import argparse
import statistics
import time

from tests.cluster.common import TEXTS
from tests.hosts.bed import Bed, Load, Partition

PROMPTS = [*TEXTS, "Three things to pack for a day in the mountains:"]
WHAT = {"cpu": "drafter and prefill worker", "redis": "Redis", "gpu": "a verifier group's node"}


def _row(host: str, load: Load, reference: dict[int, str], after: Load) -> str:
    rows = load.rows
    failed = sum(r["status"] != "ok" for r in rows)
    differing = sum(r["status"] == "ok" and r["text"] != reference[r["prompt"]] for r in rows)
    pauses = [r["longest_pause"] for r in rows if r["longest_pause"] is not None]
    ttfts = [r["ttft"] for r in rows if r["ttft"] is not None]
    whole = sum(r["status"] == "ok" and r["text"] == reference[r["prompt"]] for r in after.rows)
    return (
        f"| {WHAT.get(host, host)} (`{host}`) | {len(rows) - failed} of {len(rows)} | {differing} "
        f"| {max(pauses):.1f} s | {statistics.median(ttfts) * 1000:.0f} ms "
        f"| {whole} of {len(after.rows)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", default="cpu,redis,gpu", help="hosts to cut, in order")
    parser.add_argument("--at", type=float, default=6.0, help="seconds into the load")
    parser.add_argument("--down", type=float, default=10.0, help="seconds cut off")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    with Bed(verifier_hosts=2) as bed:
        bed.start()
        calm = bed.load(PROMPTS, len(PROMPTS) * 2, 5, args.max_tokens)
        reference = {r["prompt"]: r["text"] for r in calm.rows if r["status"] == "ok"}
        lines = [
            "| host cut off | served | texts differing | longest pause | TTFT p50 "
            "| after the mend |",
            "|---|---|---|---|---|---|",
        ]
        for host in args.hosts.split(","):
            partition = Partition(bed.network, host, args.at, args.down)
            load = bed.load(
                PROMPTS, args.requests, args.concurrency, args.max_tokens, during=partition
            )
            partition.mend()
            time.sleep(2.0)
            after = bed.load(PROMPTS, 10, 5, args.max_tokens)
            lines.append(_row(host, load, reference, after))
            print(lines[-1], flush=True)
    print(
        f"\n{args.requests} greedy streams of {args.max_tokens} tokens, {args.concurrency} at a "
        f"time; each host cut off {args.at:.0f} s in for {args.down:.0f} s.\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
