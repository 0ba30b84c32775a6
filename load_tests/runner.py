"""Running load levels: closed loop (a fixed number of users, each sending its next request as
soon as the last one ends) or open loop (Poisson arrivals at a rate, optionally capped in
flight), each with the routers' metrics polled alongside."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

from load_tests.clients import Client, RequestRecord
from load_tests.server_metrics import MetricsPoller, ServerView
from load_tests.workload import WorkItem, poisson_offsets


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: `concurrency` users (closed loop) or `rate` requests per second (open
    loop, at most `max_concurrency` in flight when set), for `num_requests` requests."""

    num_requests: int
    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a level has either a concurrency or a rate")
        if self.num_requests < 1:
            raise ValueError("a level sends at least one request")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max concurrency must be at least 1")

    @property
    def name(self) -> str:
        if self.concurrency is not None:
            return f"{self.concurrency} user{'s' if self.concurrency > 1 else ''}"
        cap = f", <= {self.max_concurrency} in flight" if self.max_concurrency else ""
        return f"{self.rate:g} req/s{cap}"


async def run_level(
    client: Client, level: Level, items: Iterator[WorkItem], seed: int = 0
) -> list[RequestRecord]:
    """Every request of the level, in the order they were due."""
    work = [next(items) for _ in range(level.num_requests)]
    records = [
        RequestRecord(level.name, client.api, item.kind, 0.0, item=item.index) for item in work
    ]
    t0 = time.perf_counter()

    async def send(index: int) -> None:
        record = records[index]
        record.start = time.perf_counter() - t0
        await client.send(work[index], record)

    if level.concurrency is not None:
        pending = iter(range(level.num_requests))

        async def user() -> None:
            for index in pending:  # shared: each user takes the next request due
                records[index].scheduled = time.perf_counter() - t0
                await send(index)

        await asyncio.gather(*(user() for _ in range(level.concurrency)))
        return records

    assert level.rate is not None
    gate = asyncio.Semaphore(level.max_concurrency or level.num_requests)

    async def arrive(index: int, offset: float) -> None:
        records[index].scheduled = offset
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
        async with gate:
            await send(index)

    offsets = poisson_offsets(level.rate, level.num_requests, seed)
    await asyncio.gather(*(arrive(i, offset) for i, offset in enumerate(offsets)))
    return records


async def measure_level(
    client: Client,
    level: Level,
    items: Iterator[WorkItem],
    poller: MetricsPoller | None = None,
    seed: int = 0,
) -> tuple[list[RequestRecord], ServerView | None]:
    """Run one level with `poller` (new for each level) watching the routers alongside."""
    if poller is None:
        return await run_level(client, level, items, seed), None
    await poller.start()
    try:
        records = await run_level(client, level, items, seed)
    finally:
        view = await poller.stop()
    return records, view
