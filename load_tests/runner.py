"""Running load levels: closed loop (a fixed number of users, each sending its next request as
soon as the last one ends) or open loop (Poisson arrivals at a rate, optionally capped in
flight), each with the routers' metrics polled alongside. With `turns` > 1 a chat request opens
a conversation: each answer goes back with a follow-up question, as a user of a chat app would
send it (the verifiers' prefix caches and prefix-aware routing see the shared history)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from load_tests.clients import Client, RequestRecord
from load_tests.server_metrics import MetricsPoller, ServerView
from load_tests.workload import FOLLOW_UPS, WorkItem, arrival_offsets


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: `concurrency` users (closed loop) or `rate` requests per second (open
    loop, at most `max_concurrency` in flight when set), for `num_requests` requests, each of
    which continues for up to `turns` turns when it is a chat."""

    num_requests: int
    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None
    turns: int = 1
    burstiness: float = 1.0  # open loop: gamma arrivals of this shape (1: Poisson)

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
        if self.turns < 1:
            raise ValueError("a conversation has at least one turn")
        if self.burstiness <= 0 or (self.burstiness != 1.0 and self.rate is None):
            raise ValueError("burstiness is positive, and only for a rate")

    @property
    def name(self) -> str:
        turns = f", {self.turns} turns" if self.turns > 1 else ""
        if self.concurrency is not None:
            return f"{self.concurrency} user{'s' if self.concurrency > 1 else ''}{turns}"
        cap = f", <= {self.max_concurrency} in flight" if self.max_concurrency else ""
        bursts = f", burstiness {self.burstiness:g}" if self.burstiness != 1.0 else ""
        return f"{self.rate:g} req/s{bursts}{cap}{turns}"


async def run_level(
    client: Client,
    level: Level,
    items: Iterator[WorkItem],
    seed: int = 0,
    done: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Every request of the level: conversations in the order they were due, each one's turns
    in order. `done` is called as each conversation ends (a progress bar)."""
    work = [next(items) for _ in range(level.num_requests)]
    conversations: list[list[RequestRecord]] = [[] for _ in work]
    t0 = time.perf_counter()

    async def converse(index: int, due: float) -> None:
        item, rng = work[index], random.Random(f"{seed}/{index}")
        for turn in range(1, level.turns + 1):
            record = RequestRecord(
                level.name, client.api, item.kind, due, item=item.index, turn=turn
            )
            conversations[index].append(record)
            record.start = time.perf_counter() - t0
            answer = await client.send(item, record)
            if not (record.ok and item.chat) or turn == level.turns:
                break
            item = item.follow_up(answer, rng.choice(FOLLOW_UPS))
            due = time.perf_counter() - t0  # the next turn is due as soon as the answer is in
        if done is not None:
            done()

    if level.concurrency is not None:
        pending = iter(range(level.num_requests))

        async def user() -> None:
            for index in pending:  # shared: each user takes the next conversation due
                await converse(index, time.perf_counter() - t0)

        await asyncio.gather(*(user() for _ in range(level.concurrency)))
    else:
        gate = asyncio.Semaphore(level.max_concurrency or level.num_requests)

        async def arrive(index: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            async with gate:
                await converse(index, offset)

        assert level.rate is not None  # a level without users has a rate (Level checks)
        offsets = arrival_offsets(level.rate, level.num_requests, seed, level.burstiness)
        await asyncio.gather(*(arrive(i, offset) for i, offset in enumerate(offsets)))
    return [record for turns in conversations for record in turns]


async def measure_level(
    client: Client,
    level: Level,
    items: Iterator[WorkItem],
    poller: MetricsPoller | None = None,
    seed: int = 0,
    done: Callable[[], None] | None = None,
) -> tuple[list[RequestRecord], ServerView | None]:
    """Run one level with `poller` (new for each level) watching the routers alongside."""
    if poller is None:
        return await run_level(client, level, items, seed, done), None
    await poller.start()
    try:
        records = await run_level(client, level, items, seed, done)
    finally:
        view = await poller.stop()
    return records, view
