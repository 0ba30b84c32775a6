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
# A poll waits this long at most: a verifier whose host is cut off never answers, and routing
# (a migration's too) must not wait for Ray to give it up.
LOAD_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """Cache affinity gives way when the cached group is this much busier than the lightest."""

    balance_threshold: int = 8
    seed: int | None = None


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
        self._load: list[LoopLoad] = []
        self._load_at = 0.0
        # Requests this replica sent to each group since the last poll: a burst that arrives
        # between polls spreads out instead of all landing on the group that looked lightest.
        self._sent_since_poll: list[int] = []

    async def load(self) -> list[LoopLoad]:
        """Each group's queue depth and KV usage, polled at most every LOAD_TTL_S."""
        now = time.monotonic()
        if now - self._load_at > LOAD_TTL_S:
            try:
                self._load = await asyncio.wait_for(self.backend.load(), LOAD_TIMEOUT_S)
            except Exception as exc:  # a group is down: route on what was last known
                log.warning("verifier load unavailable: %r", exc)
                if len(self._load) != len(self.backend.groups):
                    self._load = [LoopLoad(0, 0, 0.0) for _ in self.backend.groups]
            self._load_at = now
            self._sent_since_poll = [0] * len(self.backend.groups)
            for name, load in zip(self.backend.groups, self._load, strict=True):
                self.metrics.queue_depth.labels(name).set(load.queue_depth)
                self.metrics.kv_usage.labels(name).set(load.kv_usage)
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
            try:
                cached = await self.state.cached_blocks(prompt_ids, self.block_size, groups, salt)
            except RedisError as exc:
                self.redis.failed(exc)
        score = [
            (g.queue_depth + sent, g.kv_usage)
            for g, sent in zip(loads, self._sent_since_poll, strict=True)
        ]
        choice, reason = self._pick(score, [cached[name] for name in groups])
        self._sent_since_poll[choice] += 1
        return choice, reason

    def _pick(self, score: list[tuple[int, float]], cached: list[int]) -> tuple[int, str]:
        lightest = min(s[0] for s in score)
        best = max(cached)
        if best > 0:
            holders = [i for i, depth in enumerate(cached) if depth == best]
            fit = [i for i in holders if score[i][0] - lightest <= self.policy.balance_threshold]
            if fit:
                return self.lighter_of_two(fit, score), "prefix"
        return self.lighter_of_two(list(range(len(score))), score), "load"

    def lighter_of_two(self, candidates: list[int], score: list[tuple[int, float]]) -> int:
        """Of two candidates drawn at random, the one with the lower score (queue depth, then
        KV usage)."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(candidates, 2)
        return a if score[a] <= score[b] else b
