"""What a router replica writes to Redis about its requests, through Redis outages.

Redis is a dependency that can fail. While it is down, a replica without API keys goes on
serving: requests are not refused, they simply go unregistered (no registry, prefix hints,
shared n-gram pool or stored responses meanwhile), and what the registry should have received
(each request's registration, committed tokens, moves and end) is held here, then written once
Redis answers again, so the registry catches up. A replica with API keys refuses requests while
Redis is down: its keys' rate limits and token budgets are shared through Redis.

Only a failure to reach Redis is an outage (a connection refused or lost, a timeout, a Redis
still loading its data). Redis refusing one command (a wrong type, a script error) fails that
call alone: it is logged and the replica stays as it was.

`RedisWatch` keeps that state: whether Redis is up, the held writes, and a task that pings
Redis while it is down and writes them back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.metrics import RouterMetrics
from router.state import Registration, SharedState

log = logging.getLogger(__name__)

PING_EVERY_S = 1.0  # while Redis is down, how often it is asked whether it is back
MAX_HELD = 10_000  # requests whose registry writes are held; beyond, the oldest finished go


async def _after(before: asyncio.Task[None] | None, write: Awaitable[None]) -> None:
    if before is not None:
        await asyncio.wait([before])  # its own failure is its caller's to report
    await write


def is_outage(exc: BaseException) -> bool:
    """Whether a Redis error means Redis cannot be reached (rather than a refused command)."""
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError))


@dataclass(slots=True)
class _Held:
    """One request's registry writes that Redis did not take."""

    registration: Registration | None
    token_ids: list[int] = field(default_factory=list)
    group: str | None = None  # where it moved since
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    forget: bool = False  # `store: false`: deleted from the registry once finished


class RedisWatch:
    def __init__(self, state: SharedState, metrics: RouterMetrics, keyed: bool) -> None:
        self.state, self.metrics = state, metrics
        self.up = True
        self.keyed = keyed  # the replica has API keys: it refuses requests while Redis is down
        self._held: dict[str, _Held] = {}
        self._watch: asyncio.Task[None] | None = None
        # Run when Redis answers again, before anything else: a Redis that came back empty
        # gets the replica's key mirror back (router/server.py).
        self.on_back: list[Callable[[], Awaitable[Any]]] = []
        self._queued: dict[str, asyncio.Task[None]] = {}  # a request's last write `later`
        metrics.redis_up.set(1)

    @property
    def serving_without_redis(self) -> bool:
        """Requests are served while Redis is down (the replica has no API keys)."""
        return not self.keyed

    @property
    def held(self) -> int:
        return len(self._held)

    def failed(self, exc: RedisError) -> None:
        """Redis failed a call: an outage (`down`) if it could not be reached, else logged."""
        if is_outage(exc):
            self.down(exc)
        else:
            log.warning("Redis refused a call: %r", exc)

    def down(self, exc: BaseException) -> None:
        """Redis cannot be reached: note the outage and start watching for its end."""
        if self.up:
            self.up = False
            self.metrics.redis_up.set(0)
            self.metrics.redis_outages.inc()
            what = "serving without it" if self.serving_without_redis else "refusing requests"
            log.warning("Redis is unavailable (%r): %s until it is back", exc, what)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._wait_until_back())

    def close(self) -> None:
        """Stop watching for Redis (the replica is shutting down)."""
        if self._watch is not None:
            self._watch.cancel()

    async def shared(self, work: Callable[[], Awaitable[Any]]) -> None:
        """Bookkeeping only worth doing while Redis is up (prefix hints, the n-gram pool)."""
        if not self.up:
            return
        try:
            await work()
        except RedisError as exc:
            self.failed(exc)

    def later(self, request_id: str, write: Awaitable[None]) -> asyncio.Task[None]:
        """Run one of the request's registry writes (`register`, `commit`, `move`) off the
        caller's path, after the request's earlier ones (its writes stay in order): a stream
        never waits on Redis, whose outage is only known once a call has timed out."""
        before = self._queued.get(request_id)
        task = asyncio.ensure_future(_after(before, write))
        self._queued[request_id] = task
        task.add_done_callback(lambda done: self._dequeue(request_id, done))
        return task

    def _dequeue(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._queued.get(request_id) is task:
            del self._queued[request_id]

    async def register(self, request_id: str, entry: Registration) -> None:
        held = await self._write(request_id, lambda: self.state.register(request_id, entry))
        if held is not None:
            held.registration = entry

    async def commit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        forget: bool = False,
    ) -> None:
        held = await self._write(
            request_id,
            lambda: self.state.commit(request_id, token_ids, finish_reason, usage, forget),
        )
        if held is not None:
            held.token_ids += token_ids
            if finish_reason is not None:
                held.finish_reason, held.usage, held.forget = finish_reason, usage, forget

    async def move(self, request_id: str, group: str) -> None:
        held = await self._write(request_id, lambda: self.state.move(request_id, group))
        if held is not None:
            held.group = group

    async def _write(self, request_id: str, write: Callable[[], Awaitable[Any]]) -> _Held | None:
        """Do `write` when Redis is up and nothing of the request is held (so its writes stay
        in order): None. Else, or should it fail, the request's held writes (new ones if it had
        none), for the caller to add this write to."""
        held = self._held.get(request_id)
        if held is None and self.up:
            try:
                await write()
                return None
            except RedisError as exc:
                if not is_outage(exc):  # refused: that write is lost, the next ones go on
                    self.failed(exc)
                    self.metrics.registry_dropped.inc()
                    return None
                self.down(exc)
        if held is not None:
            return held
        self.metrics.degraded_requests.inc()  # served without Redis from here on
        return self._hold(request_id, _Held(None))

    def _hold(self, request_id: str, held: _Held) -> _Held:
        if len(self._held) >= MAX_HELD:
            finished = [rid for rid, h in self._held.items() if h.finish_reason is not None]
            for rid in (finished or list(self._held))[: len(self._held) - MAX_HELD + 1]:
                del self._held[rid]
                self.metrics.registry_dropped.inc()
        self._held[request_id] = held
        self.metrics.registry_held.set(len(self._held))
        return held

    async def _wait_until_back(self) -> None:
        while True:
            await asyncio.sleep(PING_EVERY_S)
            if not await self.state.ping():
                continue
            try:
                for hook in self.on_back:
                    await hook()
                caught_up = await self._catch_up()
            except RedisError as exc:
                log.warning("Redis answered, then failed again: %r", exc)
                continue
            # Nothing is held now, and nothing awaited since: writes go straight to Redis.
            self.up = True
            self.metrics.redis_up.set(1)
            log.warning("Redis is back: the registry caught up on %d requests", caught_up)
            return

    async def _catch_up(self) -> int:
        """Write every held request's writes, in order; how many requests."""
        done = 0
        while self._held:
            request_id, held = next(iter(self._held.items()))
            if held.registration is not None:
                await self.state.register(request_id, held.registration)
                held.registration = None
            if held.group is not None:
                await self.state.move(request_id, held.group)
                held.group = None
            # A request still running adds tokens meanwhile: written until none are left.
            while held.token_ids or held.finish_reason is not None:
                token_ids, held.token_ids = held.token_ids, []
                finish, held.finish_reason = held.finish_reason, None
                await self.state.commit(request_id, token_ids, finish, held.usage, held.forget)
            del self._held[request_id]
            done += 1
            self.metrics.registry_held.set(len(self._held))
        return done
