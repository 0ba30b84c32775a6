"""Which verifier group takes a request: the longest cached prefix of its prompt (the Redis
prefix index), unless that group is much busier than the lightest; else the lighter of two
random groups by queue depth and KV usage (the power of two choices), as the router last polled
them plus what this replica sent each since."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from router.backends import Backend
from router.metrics import RouterMetrics
from router.registry import RedisWatch
from router.state import SharedState
from workers.engine.engine_loop import LoopLoad

log = logging.getLogger(__name__)

LOAD_TTL_S = 0.1  # how long one poll of the verifiers' load is reused
# A poll that the backend did not bound in this (its groups' answers are) is given up.
LOAD_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Cache affinity gives way when the cached group is this much busier than the lightest."""

    balance_threshold: int = 8
    seed: int | None = None
    # Prefix hints not back from Redis within this are gone without: the request is routed by
    # load rather than wait (a Redis cut off answers nothing; a call's own timeout is 2 s).
    hints_within_s: float = 0.25


class GroupChooser:
    """The router's choice of group for each request (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        state: SharedState,
        redis: RedisWatch,
        metrics: RouterMetrics,
        block_size: int,
        policy: RoutingPolicy,
    ) -> None:
        self.backend, self.state, self.redis, self.metrics = backend, state, redis, metrics
        self.block_size, self.policy = block_size, policy
        self._random = random.Random(policy.seed)
        self._load: list[LoopLoad | None] = []
        self._down: list[str] = []  # groups that did not answer the last poll
        self._load_at = 0.0
        # Requests this replica sent to each group since the last poll: a burst that arrives
        # between polls spreads out instead of all landing on the group that looked lightest.
        self._sent_since_poll: list[int] = []

    async def load(self) -> list[LoopLoad | None]:
        """Each group's queue depth and KV usage, polled at most every LOAD_TTL_S; None for a
        group that did not answer (down)."""
        now = time.monotonic()
        if now - self._load_at > LOAD_TTL_S:
            try:
                self._load = await asyncio.wait_for(self.backend.load(), LOAD_TIMEOUT_S)
            except Exception as exc:  # no answer at all: every group is taken for down
                log.warning("verifier load unavailable: %r", exc)
                self._load = [None for _ in self.backend.groups]
            down = []
            for name, load in zip(self.backend.groups, self._load, strict=True):
                if load is None:
                    down.append(name)
                else:
                    self.metrics.queue_depth.labels(name).set(load.queue_depth)
                    self.metrics.kv_usage.labels(name).set(load.kv_usage)
            if down != self._down:
                log.warning("verifier groups not answering: %s", ", ".join(down) or "none")
                self._down = down
            self._load_at = now
            self._sent_since_poll = [0] * len(self.backend.groups)
        return self._load

    async def choose(self, prompt_ids: Sequence[int], salt: int = 0) -> tuple[int, str]:
        """(group index, why): longest cached prefix (of the prompt's blocks under cache
        salt `salt`), then power of two choices by load."""
        groups = self.backend.groups
        if len(groups) == 1:
            return 0, "only"
        loads = await self.load()
        cached = dict.fromkeys(groups, 0)  # without prefix hints, routed by load alone
        if self.redis.up:
            hints = self.state.cached_blocks(prompt_ids, self.block_size, groups, salt)
            try:
                cached = await asyncio.wait_for(hints, self.policy.hints_within_s)
            except TimeoutError:  # Redis slow or cut off: its outage is the registry's to find
                self.metrics.hints_late.inc()
            except RedisError as exc:
                self.redis.failed(exc)
        score = scores(loads, self._sent_since_poll)
        # A group that did not answer gets nothing while another does.
        up = [i for i, load in enumerate(loads) if load is not None] or list(range(len(groups)))
        choice, reason = self._pick(score, [cached[name] for name in groups], up)
        self._sent_since_poll[choice] += 1
        return choice, reason

    def _pick(
        self, score: list[tuple[int, float]], cached: list[int], up: list[int]
    ) -> tuple[int, str]:
        lightest = min(score[i][0] for i in up)
        best = max(cached[i] for i in up)
        if best > 0:
            holders = [i for i in up if cached[i] == best]
            fit = [i for i in holders if score[i][0] - lightest <= self.policy.balance_threshold]
            if fit:
                return self.lighter_of_two(fit, score), "prefix"
        return self.lighter_of_two(up, score), "load"

    def lighter_of_two(self, candidates: list[int], score: list[tuple[int, float]]) -> int:
        """Of two candidates drawn at random, the one with the lower score (queue depth, then
        KV usage)."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(candidates, 2)
        return a if score[a] <= score[b] else b


def scores(
    loads: Sequence[LoopLoad | None], sent: Sequence[int] | None = None
) -> list[tuple[int, float]]:
    """Each group's (queue depth, KV usage) to route by, counting `sent` requests routed since
    the poll; a group that did not answer scores as the busiest possible."""
    sent = sent or [0] * len(loads)
    return [
        (2**31, 1.0) if load is None else (load.queue_depth + extra, load.kv_usage)
        for load, extra in zip(loads, sent, strict=True)
    ]
