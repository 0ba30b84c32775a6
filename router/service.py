"""The router's core, shared by the HTTP and gRPC front ends.

Per request: authenticate (the replica's own API keys, router/keys.py), take from the key's
rate-limit bucket (Redis, shared by every replica), admit (a bounded number of unfinished
requests per replica, 503 beyond it, and per key, 429 beyond its `concurrency`; its prompt and
most tokens taken from its token bucket, 429 when empty, what went unused given back at the
end), pick a verifier group (longest cached prefix from the Redis prefix index, then the
lighter of two random groups by queue depth and KV usage), register the request in Redis (owned
by its key: other keys are told it does not exist), stream its steps, and on the way record
metrics, committed tokens and the blocks the group now holds.
Leaving the stream early (client gone) aborts the request in its verifier.

A verifier group that fails under a request (its actor dies, a rank of it restarts) does not
end it: the request goes on from its committed tokens on a healthy group, or on the same one
once Ray has it back (`router.migration`), as a `Continuation` the engine takes up as if the
request had never left (its text, statistics and a seeded request's draws go on as in one
run). The client's stream only pauses; the move is counted (`outrider_migrations`) and named in
the request's log line and its new span.

Conditional disaggregation is decided in the verifier, which knows what its prefix cache holds:
prompts with fewer than `pools.prefill.min_remote_prompt_tokens` uncached tokens skip the
prefill pool.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, TypeVar

from cluster import logs
from cluster.config import MigrationSettings
from router import errors
from router.admission import CALLER, Admission, owner, salted
from router.backends import Backend, Step
from router.keys import ApiKey, KeyRing
from router.metrics import RouterMetrics
from router.protocol import GenerateRequest, RequestBuilder
from router.registry import RedisWatch
from router.resume import resumed_request, settings_json
from router.routing import GroupChooser, RoutingPolicy, scores
from router.state import LEASE_S, Registration, SharedState
from workers.engine.engine_loop import LoopLoad
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.outputs import Continuation
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# The API a request came in by (chat, completions, responses, grpc), set where it came in: the
# request's log line names it.
REQUEST_API: ContextVar[str] = ContextVar("outrider_request_api", default="")
WORK_THREADS = 4  # requests being parsed and tokenized at once on one replica
T = TypeVar("T")

# A choice of a request: its first step, and its steps after that.
Choice = tuple[Step, AsyncGenerator[Step, None]]

REGISTRY_FLUSH_S = 0.25  # committed tokens reach the registry at least this often
MIGRATION_POLL_S = 0.5  # how often a migrating request asks whether a group is back


class RouterService:
    def __init__(
        self,
        backend: Backend,
        builder: RequestBuilder,
        state: SharedState,
        block_size: int,
        max_queue: int = 256,
        policy: RoutingPolicy | None = None,
        replica: str | None = None,
        migration: MigrationSettings | None = None,
        keys: KeyRing | None = None,
        lease_s: float = LEASE_S,
    ) -> None:
        self.backend, self.builder, self.state = backend, builder, state
        self.keys = keys or KeyRing()
        self.block_size, self.max_queue = block_size, max_queue
        self.migration = migration or MigrationSettings()
        self.replica = replica or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.metrics = RouterMetrics()
        # Redis's outages, and the writes they held.
        self.redis = RedisWatch(state, self.metrics, self.keys.configured)
        self.in_flight = 0
        self.admission = Admission(self.keys, state, self.redis, self.replica, lease_s)
        self.draining = False  # shutting down: new requests are refused (Router.drain)
        self.cut = False  # the drain's grace is over: requests in flight end at their next step
        self.routing = GroupChooser(
            backend, state, self.redis, self.metrics, block_size, policy or RoutingPolicy()
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        # Parsing, validating and tokenizing a request (chat templates, grammars) is CPU work
        # that takes a second for a large prompt: it runs on these threads, so the event loop
        # goes on answering probes and streaming other requests meanwhile.
        self._work = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="router-work")

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the router's work threads (its exceptions raised here)."""
        return await asyncio.get_running_loop().run_in_executor(self._work, fn, *args)

    @property
    def model_name(self) -> str:
        return self.builder.model_name

    async def authorize(self, api_key: str | None) -> ApiKey | None:
        return await self.admission.authorize(api_key)

    @staticmethod
    def owner() -> str:
        return owner()

    async def ready(self) -> str | None:
        """ "ready"; "degraded" while Redis is down and requests are served without it; None
        when requests cannot be served (a verifier group or Redis with API keys is down)."""
        if not await self.backend.ready():
            return None
        if await self.state.ping():
            return "ready"
        self.redis.down(ConnectionError("no answer to PING"))
        return "degraded" if self.redis.serving_without_redis else None

    async def load(self) -> list[LoopLoad | None]:
        return await self.routing.load()

    async def choose_group(self, prompt_ids: Sequence[int], salt: int = 0) -> tuple[int, str]:
        return await self.routing.choose(prompt_ids, salt)

    async def start(self, requests: Sequence[GenerateRequest], request_id: str) -> list[Choice]:
        """The choices of a request (one `GenerateRequest` per prompt of a batch), each past
        its first step, so that a refusal surfaces before an answer goes out; in order, a
        prompt's `n` choices after the last prompt's. A lone choice runs as `request_id`; else
        choice k runs as `<request_id>-<k>`. Prompts are routed each on its own; the choices of
        one prompt run on its verifier group (a seeded request's choice i with seed + i), the
        first alone until its first token, when the group's prefix cache holds the prompt's
        blocks, then the others at once, starting from those blocks."""
        total = sum(r.n for r in requests)
        if total == 1:
            steps = self.generate(requests[0], request_id)
            return [(await anext(steps), steps)]
        names = iter(f"{request_id}-{k}" for k in range(total))
        ids = [[next(names) for _ in range(r.n)] for r in requests]
        tasks = [
            asyncio.ensure_future(self._start_choices(r, i))
            for r, i in zip(requests, ids, strict=True)
        ]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # this caller was cancelled (its client left) while they started
            for task in tasks:
                task.cancel()  # a prompt still starting closes what it started itself
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close([t for t in tasks if not t.cancelled() and t.exception() is None])
            raise
        error = next((e for e in (t.exception() for t in tasks) if e is not None), None)
        if error is not None:
            await _close([t for t in tasks if t.exception() is None])
            raise error
        return [choice for task in tasks for choice in task.result()]

    async def _start_choices(self, request: GenerateRequest, ids: list[str]) -> list[Choice]:
        """One prompt's choices, on one verifier group, the first one first."""
        request = salted(request)
        routed = await self.choose_group(request.prompt_ids, request.params.cache_salt)
        gens = [
            self.generate(_choice(request, i), rid, routed, (ids[0], i) if i else None)
            for i, rid in enumerate(ids)
        ]
        firsts: list[Step | BaseException] = []
        try:
            firsts.append(await anext(gens[0]))
            firsts += await asyncio.gather(*(anext(g) for g in gens[1:]), return_exceptions=True)
        finally:
            refused = [f for f in firsts if isinstance(f, BaseException)]
            if refused or len(firsts) < len(gens):
                for gen in gens:
                    await gen.aclose()  # aborts the choices that started
        if refused:
            raise refused[0]
        started = [f for f in firsts if not isinstance(f, BaseException)]
        return list(zip(started, gens, strict=True))

    async def generate(
        self,
        request: GenerateRequest,
        request_id: str,
        routed: tuple[int, str] | None = None,
        shared: tuple[str, int] | None = None,
    ) -> AsyncGenerator[Step, None]:
        """The request's steps; raises `RouterError` before the first one when refused.
        `routed`: the verifier group (and why) when the caller chose it; `shared`: (request
        id, index) of a choice after the first of its prompt, which keeps the prompt and the
        settings for resuming it."""
        if self.draining:
            raise errors.overloaded("this replica is shutting down; another one will answer")
        if self.in_flight >= self.max_queue:
            raise errors.overloaded(
                f"the server has {self.in_flight} requests in flight (limit {self.max_queue})"
            )
        request = salted(request)
        share = self.admission.share(request)  # before admission: a bad priority is a 400
        ticket = await self.admission.admit(request)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            async for step in self._generate(request, request_id, routed, shared, share):
                ticket.used += len(step.new_token_ids)
                yield step
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            ticket.release()

    async def _generate(
        self,
        request: GenerateRequest,
        request_id: str,
        routed: tuple[int, str] | None,
        shared: tuple[str, int] | None,
        share: Share = DEFAULT_SHARE,
    ) -> AsyncGenerator[Step, None]:
        logs.REQUEST_ID.set(request_id)  # this request's task: every line it logs names it
        start = time.perf_counter()
        salt = request.params.cache_salt
        group, reason = routed or await self.choose_group(request.prompt_ids, salt)
        name = self.backend.groups[group]
        self.metrics.routed.labels(name, reason).inc()
        source, index = shared or (None, 0)
        settings = "" if source is not None else settings_json(request)
        entry = Registration(
            name, self.replica, self.owner(), request.prompt_ids, settings, source, index
        )
        self._background(self.redis.later(request_id, self.redis.register(request_id, entry)))
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        output_ids: list[int] = []
        num_registered = 0  # of output_ids, already in the registry
        last = flushed = start
        first: float | None = None
        final: Step | None = None
        finish_reason = "abort"
        error: Exception | None = None
        moves: list[str] = []  # the groups this request left, failed under it
        continuation: Continuation | None = None
        cached = 0  # prompt tokens its first group found cached
        latest: Step | None = None
        try:
            while final is None:
                steps = self.backend.stream(
                    group,
                    request_id,
                    request.prompt_ids,
                    _continued(request.params, continuation),
                    request.spec,
                    continuation,
                    share,
                )
                try:
                    async for step in steps:
                        if self.cut:  # the committed tokens reach the registry below
                            raise errors.overloaded(
                                f"this replica shut down before request {request_id} finished; "
                                f"POST /v1/requests/{request_id}/resume to any replica goes on "
                                "with it"
                            )
                        latest = step
                        if continuation is None:
                            cached = step.num_cached_tokens
                        else:  # its new group computed what the first one found cached
                            step.num_cached_tokens = cached
                        now = time.perf_counter()
                        if step.new_token_ids:
                            if not output_ids:
                                first = now
                                self.metrics.ttft.observe(now - start)
                                self._record_prefix(request.prompt_ids, name, salt)
                            else:
                                per_token = (now - last) / len(step.new_token_ids)
                                for _ in step.new_token_ids:
                                    self.metrics.itl.observe(per_token)
                            last = now
                            output_ids += step.new_token_ids
                            self.metrics.generation_tokens.inc(len(step.new_token_ids))
                        if step.finished:
                            final = step
                            finish_reason = step.finish_reason or "stop"
                            self._finished(request, step, start, name, output_ids)
                        elif len(output_ids) > num_registered and now - flushed >= REGISTRY_FLUSH_S:
                            commit = self.redis.commit(request_id, output_ids[num_registered:])
                            self._background(self.redis.later(request_id, commit))
                            num_registered, flushed = len(output_ids), now
                        yield step
                except errors.GroupFailed as exc:
                    if len(moves) >= self.migration.max_attempts:
                        raise
                    moves.append(name)
                    group = await self._group_after_failure(group, exc)
                    name = self.backend.groups[group]
                    if output_ids:  # else it simply starts again
                        assert latest is not None
                        stats = copy.deepcopy(latest.spec)
                        continuation = Continuation(tuple(output_ids), stats)
                    self.metrics.migrations.labels(moves[-1], name).inc()
                    log.warning(
                        "verifier %s failed under request %s after %d tokens: it goes on on %s",
                        moves[-1],
                        request_id,
                        len(output_ids),
                        name,
                    )
                    self._background(
                        self.redis.later(request_id, self.redis.move(request_id, name))
                    )
        except Exception as exc:
            error = exc
            raise
        finally:
            usage = None if finish_reason == "abort" else {"finish_reason": finish_reason}
            rest = output_ids[num_registered:]
            forget = not request.store and final is not None  # an aborted one may be resumed
            end = self.redis.commit(request_id, rest, finish_reason, usage, forget)
            self._background(self.redis.later(request_id, end))
            caller = CALLER.get()  # the key's name in the line, never the key
            line = {
                "request_id": request_id,
                "api": REQUEST_API.get(),
                **({} if caller is None else {"key": caller.name}),
                "outcome": "ok" if final else "failed" if error else "aborted",
                "finish_reason": None if final is None else finish_reason,
                "prompt_tokens": len(request.prompt_ids),
                "output_tokens": len(output_ids),
                "ttft_ms": None if first is None else round((first - start) * 1000, 1),
                "latency_ms": round((time.perf_counter() - start) * 1000, 1),
                "group": name,
                "routed_by": reason,
                **({} if final is None else _spec_fields(final)),
                **({"migrated_from": moves} if moves else {}),
                **({"resumed_tokens": request.resumed_tokens} if request.resumed_tokens else {}),
                **({"error": str(error)} if error else {}),
            }
            logs.request_line(line)

    async def _group_after_failure(self, failed: int, exc: errors.GroupFailed) -> int:
        """A group to go on with after `failed` failed: a healthy other one (the lighter of
        two by load), else `failed` itself once it is back; raises `exc` if none answers within
        `migration.max_wait_s`."""
        deadline = time.monotonic() + self.migration.max_wait_s
        groups = range(len(self.backend.groups))
        while True:
            answers = await asyncio.gather(*(self.backend.healthy(g) for g in groups))
            healthy = [g for g in groups if answers[g]]
            others = [g for g in healthy if g != failed]
            if healthy:
                score = scores(await self.load())
                return self.routing.lighter_of_two(others or healthy, score)
            if time.monotonic() >= deadline:
                raise exc
            await asyncio.sleep(MIGRATION_POLL_S)

    async def lookup_request(self, request_id: str) -> dict[str, Any]:
        """A request's registry entry, if the caller's key made it; else 404, as for one
        that does not exist."""
        record = await self.state.lookup_request(request_id)
        if record is None or record.get("owner", "") != self.owner():
            raise errors.not_found(f"no request {request_id!r} in the registry")
        return record

    def refused(self, api: str, exc: errors.RouterError) -> None:
        """Count and log a request refused before it was served (its status in the line)."""
        self.metrics.requests.labels(api, "refused").inc()
        logs.request_line(
            {
                "request_id": logs.REQUEST_ID.get(),
                "api": api,
                "outcome": "refused",
                "status": exc.status,
                "error": exc.message,
            }
        )

    async def resume(self, request_id: str, stream: bool) -> tuple[GenerateRequest, list[int]]:
        """The rest of a request another replica started and did not finish (its replica died,
        or its client left): the same settings over its prompt plus the tokens it committed,
        and those tokens. Greedy requests resume exactly where they stopped."""
        record = await self.lookup_request(request_id)
        reason = record.get("finish_reason")
        if record["state"] == "finished" and reason != "abort":
            raise errors.bad_request(
                f"request {request_id!r} finished ({reason}): nothing to resume"
            )
        kept = await self.state.lookup_resume(request_id, record)
        if kept is None:
            raise errors.bad_request(
                f"request {request_id!r} cannot be resumed: its prompt and settings were over "
                "the registry's size limit, or have expired"
            )
        prompt_ids, settings = kept
        committed = record["token_ids"]
        resumed = resumed_request(settings, record.get("choice", 0), prompt_ids, committed, stream)
        if resumed is None:
            raise errors.bad_request(f"request {request_id!r} has no tokens left to generate")
        return resumed, committed

    def _finished(
        self,
        request: GenerateRequest,
        step: Step,
        start: float,
        group: str,
        output_ids: list[int],
    ) -> None:
        self.metrics.e2e.observe(time.perf_counter() - start)
        spec = step.spec
        self.metrics.drafted.inc(spec.drafted)
        self.metrics.accepted.inc(spec.accepted)
        if spec.verify_steps:
            self.metrics.acceptance_length.observe(spec.mean_acceptance_length)
        # The conversation so far is cached in that group now: the next turn should go there.
        tokens = [*request.prompt_ids, *output_ids]
        salt = request.params.cache_salt
        self._record_prefix(tokens, group, salt)
        if output_ids and not salt:  # an isolated request shares no n-grams either
            self._background(self.redis.shared(lambda: self.state.share_sequence(tokens)))

    def _record_prefix(self, token_ids: list[int], group: str, salt: int) -> None:
        """Note in the prefix index that `group` holds these tokens' blocks."""
        self._background(
            self.redis.shared(
                lambda: self.state.record_prefix(token_ids, self.block_size, group, salt)
            )
        )

    def _background(self, work: Awaitable[Any]) -> None:
        """Bookkeeping that must not delay tokens or fail the request."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A Redis hiccup on bookkeeping: the request itself has its tokens.
            log.warning("router bookkeeping failed: %r", task.exception())

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _continued(params: SamplingParams, continuation: Continuation | None) -> SamplingParams:
    """A request's settings on the group it moved to: its prompt was scored already."""
    if continuation is None or params.prompt_logprobs is None:
        return params
    return replace(params, prompt_logprobs=None)


def _spec_fields(step: Step) -> dict[str, Any]:
    spec = step.spec
    return {
        "cached_tokens": step.num_cached_tokens,
        "drafted": spec.drafted,
        "accepted": spec.accepted,
        "verify_steps": spec.verify_steps,
    }


async def _close(started: list[asyncio.Task[list[Choice]]]) -> None:
    """Abort the choices these prompts started."""
    for task in started:
        for _, steps in task.result():
            await steps.aclose()


def _choice(request: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of a request with several: its own seed when the request has one."""
    seed = request.params.seed
    params = request.params if seed is None else replace(request.params, seed=seed + index)
    return replace(request, params=params, n=1)
