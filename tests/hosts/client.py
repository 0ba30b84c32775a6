"""The load generator of the multi-host test bed, run on its `client` host:
`python -m tests.hosts.client --url URL --prompts FILE --requests N --concurrency C --out FILE`.

Greedy completions streamed with load_tests' HTTP client, the prompts taken round robin; it
writes each request's text, status, time to first token and longest pause between two
streamed pieces (the first piece's wait counts as a pause), and its whole RequestRecord, in the
order they were asked."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from load_tests.clients import HttpClient, RequestRecord, Sampling, served_model
from load_tests.stats import inter_chunk_gaps
from load_tests.workload import WorkItem


def longest_pause(record: RequestRecord) -> float | None:
    """The wait for the first piece, or the longest gap between two after it."""
    if record.ttft is None:
        return None
    return max([record.ttft, *inter_chunk_gaps(record)])


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts: list[str] = json.loads(Path(args.prompts).read_text())["prompts"]
    async with aiohttp.ClientSession() as session:
        model = await served_model(session, args.url)
    client = HttpClient(args.url, Sampling(model, max_tokens=args.max_tokens, timeout_s=300.0))
    rows: list[dict[str, Any]] = [{} for _ in range(args.requests)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)

    async def user() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            item = WorkItem("completion", prompt=prompts[i % len(prompts)], index=i)
            record = RequestRecord(level="hosts", api="http", kind=item.kind, scheduled=0.0)
            text = await client.send(item, record)
            rows[i] = {
                "prompt": i % len(prompts),
                "text": text,
                "status": record.status,
                "error": record.error,
                "ttft": record.ttft,
                "latency": record.latency,
                "longest_pause": longest_pause(record),
                "drafted": record.drafted,
                "record": record.to_json(),
            }

    try:
        await asyncio.gather(*(user() for _ in range(args.concurrency)))
    finally:
        await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
