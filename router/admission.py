"""Who may send what: a replica's API keys and the limits each one runs under.

`authorize` checks the caller's key against the replica's own keys (router/keys.py) and takes a
request from its request bucket (Redis, shared by the replicas); from then on the key is the
task's `CALLER`, so what the task starts is owned by it (`owner()`: the registry entries and
stored responses other keys are told do not exist) and counted against it. `admit` lets one
sequence (a choice) in: at most `concurrency` of a key's at once on this replica (429 beyond),
its prompt and most tokens taken from the key's token bucket (429 when empty; what it did not
use is given back when it ends).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from redis.exceptions import RedisError

from router import errors
from router.keys import ApiKey, KeyRing
from router.protocol import GenerateRequest
from router.registry import RedisWatch
from router.state import LEASE_S, SharedState
from workers.engine.fair_share import Share

# The API key a request came with (None where the replica has no keys), set by `authorize` in
# the request's task and seen by every task it starts.
CALLER: ContextVar[ApiKey | None] = ContextVar("outrider_caller", default=None)


def owner() -> str:
    """Whose the objects this task makes or reads are: its key's digest ("" without keys)."""
    key = CALLER.get()
    return "" if key is None else key.digest


def cache_salt(request: GenerateRequest) -> int:
    """The root of `request`'s prefix-cache hash chain: its own `cache_salt` and, where the
    caller's key is isolated (`isolate_cache`), the key; 0 (shared by all) with neither."""
    key = CALLER.get()
    parts = [key.digest] if key is not None and key.limits.isolate_cache else []
    if request.cache_salt:
        parts.append(request.cache_salt)
    if not parts:
        return 0
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def salted(request: GenerateRequest) -> GenerateRequest:
    """`request` with its cache salt in its sampling parameters, as the engine reads it."""
    salt = cache_salt(request)
    if salt == request.params.cache_salt:
        return request
    return replace(request, params=replace(request.params, cache_salt=salt))


@dataclass(slots=True)
class Ticket:
    """One admitted sequence: `used` counts its generated tokens; `release` when it ends."""

    admission: Admission
    key: ApiKey | None
    reserved: int = 0  # completion tokens (max_tokens) taken from the key's token bucket
    used: int = 0
    lease: str | None = None  # its place among the key's `concurrency`, over all replicas
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.admission.release(self)


class Admission:
    def __init__(
        self,
        keys: KeyRing,
        state: SharedState,
        redis: RedisWatch,
        replica: str = "",
        lease_s: float = LEASE_S,
    ) -> None:
        self.keys, self.state, self.redis = keys, state, redis
        self.replica, self.lease_s = replica, lease_s
        self.in_flight: dict[str, int] = {}  # API key digest -> its unfinished sequences here
        # The concurrency leases this replica holds (lease id -> key digest), renewed by
        # `renew_leases` until released.
        self.leases: dict[str, str] = {}
        self._refunds: set[asyncio.Task[Any]] = set()

    async def authorize(self, api_key: str | None) -> ApiKey | None:
        """The caller's key (None when the replica has no keys), a request taken from its
        bucket; the key is the `CALLER` of what this task starts from now on."""
        key = self._authenticate(api_key)
        CALLER.set(key)
        if key is None:
            return None
        # A key at its concurrency is refused here already, before its body is parsed and
        # tokenized: a client flooding past its limit costs the replica little (`admit` is
        # the check that counts).
        self._check_concurrency(key)
        if not self.redis.up:  # the key's limits are shared through Redis
            raise errors.shared_state_down(ConnectionError("Redis is unavailable"))
        if key.requests_per_s <= 0 and not await self.state.ping():
            # No bucket to draw from, but a request with a key is not served without Redis:
            # an outage is noticed here, not after the request was let in.
            unavailable = ConnectionError("no answer to PING")
            self.redis.down(unavailable)
            raise errors.shared_state_down(unavailable)
        try:
            decision = await self.state.take(key)
        except RedisError as exc:
            self.redis.failed(exc)
            raise errors.shared_state_down(exc) from exc
        if not decision.allowed:
            raise errors.rate_limited(decision.retry_after_s)
        return key

    def _authenticate(self, api_key: str | None) -> ApiKey | None:
        if not self.keys.configured:
            return None
        if not api_key:
            raise errors.unauthorized("missing API key (Authorization: Bearer <key>)")
        key = self.keys.lookup(api_key)
        if key is None:
            raise errors.unauthorized("invalid API key")
        return key

    async def admit(self, request: GenerateRequest) -> Ticket:
        """Let one sequence of the caller's in, or refuse it (429)."""
        key = CALLER.get()
        ticket = Ticket(self, key)
        if key is None:
            return ticket
        self._check_concurrency(key)
        if key.limits.max_concurrent > 0:
            await self._take_lease(key, ticket)
        try:
            if key.limits.tokens_per_s > 0:
                await self._take_tokens(key, request, ticket)
        except BaseException:
            self._release_lease(ticket)
            raise
        # Counted after the await: others of the key may have come or gone meanwhile.
        self.in_flight[key.digest] = self.in_flight.get(key.digest, 0) + 1
        return ticket

    async def _take_lease(self, key: ApiKey, ticket: Ticket) -> None:
        """A place among the key's `concurrency` over every replica (a lease in Redis that
        this replica renews while the request runs), or 429."""
        lease = f"{self.replica}:{uuid.uuid4().hex}"
        try:
            taken = await self.state.take_lease(key, lease, self.lease_s)
        except RedisError as exc:
            self.redis.failed(exc)
            raise errors.shared_state_down(exc) from exc
        if not taken:
            raise errors.too_many_concurrent(key.limits.max_concurrent)
        ticket.lease = lease
        self.leases[lease] = key.digest

    def _release_lease(self, ticket: Ticket) -> None:
        lease = ticket.lease
        if lease is None:
            return
        ticket.lease = None
        digest = self.leases.pop(lease)
        self._background(lambda: self.state.release_lease(digest, lease))

    async def renew_leases(self) -> None:
        """Keep this replica's leases alive (every `lease_s` / 3: router/server.py)."""
        leases = [(digest, lease) for lease, digest in self.leases.items()]
        await self.redis.shared(lambda: self.state.renew_leases(leases, self.lease_s))

    def _background(self, work: Callable[[], Awaitable[Any]]) -> None:
        """Redis bookkeeping that nobody waits for (refunds, released leases)."""
        task = asyncio.ensure_future(self.redis.shared(work))
        self._refunds.add(task)
        task.add_done_callback(self._refunds.discard)

    def share(self, request: GenerateRequest) -> Share:
        """The request's place in the engine's fair share: its API key's (or, without keys,
        its `user`'s) tenant and weight, and its priority, never more urgent than the key
        allows (400)."""
        key = CALLER.get()
        if key is None:
            priority = 0 if request.priority is None else request.priority
            return Share(request.user or "", 1.0, priority)
        limits = key.limits
        priority = limits.priority if request.priority is None else request.priority
        if priority < limits.best_priority:
            raise errors.bad_request(
                f"priority {priority} is more urgent than this API key may ask for (at most "
                f"{limits.best_priority}; lower runs first)",
                "priority",
            )
        return Share(key.name, limits.weight, priority)

    def _check_concurrency(self, key: ApiKey) -> None:
        """429 when the key has its `concurrency` of unfinished sequences here."""
        limit = key.limits.max_concurrent
        if 0 < limit <= self.in_flight.get(key.digest, 0):
            raise errors.too_many_concurrent(limit)

    async def _take_tokens(self, key: ApiKey, request: GenerateRequest, ticket: Ticket) -> None:
        cost = len(request.prompt_ids) + request.params.max_tokens
        if cost > key.limits.tokens_burst:
            raise errors.bad_request(
                f"the prompt and max_tokens ({cost} tokens) are over this API key's token "
                f"burst ({key.limits.tokens_burst})",
                "max_tokens",
            )
        try:
            decision = await self.state.take_tokens(key, cost)
        except RedisError as exc:
            self.redis.failed(exc)
            raise errors.shared_state_down(exc) from exc
        if not decision.allowed:
            raise errors.rate_limited(decision.retry_after_s, "token rate limit")
        ticket.reserved = request.params.max_tokens

    def release(self, ticket: Ticket) -> None:
        key = ticket.key
        if key is None:
            return
        self._release_lease(ticket)
        left = self.in_flight[key.digest] - 1
        if left:
            self.in_flight[key.digest] = left
        else:
            del self.in_flight[key.digest]
        unused = ticket.reserved - ticket.used
        if unused > 0:  # give back what the sequence did not generate
            self._background(lambda: self.state.take_tokens(key, -unused))
