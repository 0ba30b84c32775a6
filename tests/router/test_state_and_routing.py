"""The Redis-backed state against a real redis-server, and the routing policy over a scripted
backend (a fake of one piece: the verifier groups' load)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest

from router import errors
from router.backends import Step
from router.keys import ApiKey, KeyLimits, key_digest
from router.protocol import GenerateRequest
from router.redis_server import EmbeddedRedis
from router.routing import RoutingPolicy
from router.service import RouterService
from router.state import MAX_RESUME_BYTES, Registration, SharedState
from workers.engine.engine_loop import LoopLoad
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats

BLOCK = 4


@pytest.fixture
def state(redis_server: EmbeddedRedis) -> Iterator[Any]:
    """A `SharedState` factory on a flushed database; each test runs in its own event loop."""
    import redis.asyncio as aioredis

    url = f"redis://127.0.0.1:{redis_server.port}/5"

    async def make() -> SharedState:
        client = aioredis.Redis.from_url(url)
        await client.flushdb()
        return SharedState(client)

    yield make


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _key(secret: str, name: str, **limits: Any) -> ApiKey:
    return ApiKey(name, key_digest(secret), KeyLimits(**limits))


def test_token_buckets_refill_at_their_rate_and_take_refunds(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> list[Any]:
        s = await state()
        key = _key("sk-1", "one", requests_per_s=20.0, burst=2)
        first = [(await s.take(key)).allowed for _ in range(3)]
        refused = await s.take(key)
        await asyncio.sleep(0.06)  # 1.2 tokens back
        again = (await s.take(key)).allowed
        unlimited = _key("sk-2", "two")
        free = [(await s.take(unlimited)).allowed for _ in range(50)]
        tokens = _key("sk-3", "three", tokens_per_s=1.0, token_burst=100)
        drawn = [(await s.take_tokens(tokens, 60)).allowed for _ in range(2)]
        await s.take_tokens(tokens, -50)  # a request used 10 of its 60
        refunded = (await s.take_tokens(tokens, 80)).allowed
        await s.close()
        return [first, refused, again, all(free), drawn, refunded]

    first, refused, again, free, drawn, refunded = run(scenario())
    assert first == [True, True, False]
    assert not refused.allowed and 0 < refused.retry_after_s <= 0.05 + 1e-6
    assert again and free
    assert drawn == [True, False] and refunded  # 40 left, 50 back (capped at the burst): 90


def test_the_key_mirror_is_rewritten_whole_and_holds_digests_only(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> tuple[Any, ...]:
        s = await state()
        await s.sync_keys([_key("sk-secret", "svc", requests_per_s=5.0, burst=10)])
        first = await s.mirrored_keys()
        await s.sync_keys([_key("sk-other", "new")])  # sk-secret revoked
        second = await s.mirrored_keys()
        ttl = await s.redis.ttl("outrider:keys")
        await s.close()
        return first, second, ttl

    first, second, ttl = run(scenario())
    assert list(first) == [key_digest("sk-secret")] and "sk-secret" not in str(first)
    assert first[key_digest("sk-secret")]["name"] == "svc"
    assert list(second) == [key_digest("sk-other")] and 0 < ttl <= 600


def _entry(prompt: list[int], settings: str = "{}", **kw: Any) -> Registration:
    return Registration("verifier-g1-r0", "replica-a", "owner-a", prompt, settings, **kw)


def test_registry_appends_committed_tokens(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> Any:
        s = await state()
        await s.register("r1", _entry([1, 2, 3, 4, 5, 6, 7]))
        await s.commit("r1", [5, 6])
        await s.commit("r1", [7], "stop", {"finish_reason": "stop"})
        record = await s.lookup_request("r1")
        prompt, _ = await s.lookup_resume("r1", record)
        await s.close()
        return record, prompt

    record, prompt = run(scenario())
    assert prompt == [1, 2, 3, 4, 5, 6, 7] and record["settings"] == {}
    assert record["owner"] == "owner-a"
    assert record["group"] == "verifier-g1-r0" and record["replica"] == "replica-a"
    assert record["token_ids"] == [5, 6, 7] and record["state"] == "finished"
    assert record["prompt_tokens"] == 7 and record["usage"] == {"finish_reason": "stop"}


def test_resume_data_is_kept_once_a_prompt_and_within_its_cap(state) -> None:  # type: ignore[no-untyped-def]
    """Choices after the first share its prompt and settings; a request whose prompt and
    settings pass the cap is registered without them; `forget` deletes all of a request, and
    a write that comes after does not bring any of it back."""

    async def scenario() -> tuple[Any, ...]:
        s = await state()
        long_prompt = list(range(70_000))  # past 4096 tokens: kept whole
        await s.register("r-0", _entry(long_prompt, '{"a": 1}'))
        await s.register("r-1", _entry(long_prompt, "", resume_from="r-0", choice=1))
        shared = await s.lookup_resume("r-1", await s.lookup_request("r-1"))
        keys_of_r1 = await s.redis.keys("outrider:request:r-1*")
        big = "x" * MAX_RESUME_BYTES
        await s.register("big", _entry([1, 2], json_string(big)))
        huge = await s.lookup_request("big")
        kept = await s.lookup_resume("big", huge)
        size = await s.redis.memory_usage("outrider:request:big")
        await s.commit("r-0", [1, 2], "stop", None, forget=True)
        await s.commit("r-0", [3], "stop", {"finish_reason": "stop"})  # late: no entry again
        await s.move("r-0", "verifier-g2-r0")
        gone = await s.redis.keys("outrider:request:r-0*")
        await s.close()
        return shared, keys_of_r1, huge, kept, size, gone

    shared, keys_of_r1, huge, kept, size, gone = run(scenario())
    assert shared == (list(range(70_000)), {"a": 1})
    assert keys_of_r1 == [b"outrider:request:r-1"]  # no prompt of its own
    assert huge["state"] == "running" and "settings" not in huge and kept is None
    assert size < 4096 and gone == []


def json_string(text: str) -> str:
    import json

    return json.dumps({"stop": [text]})


def test_prefix_index_finds_the_longest_cached_prefix_per_group(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> list[dict[str, int]]:
        s = await state()
        shared = list(range(100, 112))  # three blocks
        await s.record_prefix([*shared, 1, 2, 3, 4], BLOCK, "g0")  # four blocks
        await s.record_prefix(shared[:8], BLOCK, "g1")  # two blocks
        groups = ["g0", "g1", "g2"]
        out = [
            await s.cached_blocks([*shared, 1, 2, 3, 4, 9], BLOCK, groups),
            await s.cached_blocks([*shared[:8], 0, 0, 0, 0], BLOCK, groups),
            await s.cached_blocks([0, *shared], BLOCK, groups),  # shifted: nothing matches
        ]
        await s.close()
        return out

    deep, shallow, shifted = run(scenario())
    assert deep == {"g0": 4, "g1": 2, "g2": 0}
    assert shallow == {"g0": 2, "g1": 2, "g2": 0}
    assert shifted == {"g0": 0, "g1": 0, "g2": 0}


class ScriptedBackend:
    """Verifier groups with set loads, each answering with one token."""

    def __init__(self, loads: list[LoopLoad]) -> None:
        self.loads = loads
        self.groups = [f"g{i}" for i in range(len(loads))]
        self.served: list[int] = []

    async def stream(self, group: int, *args: Any) -> AsyncGenerator[Step, None]:
        self.served.append(group)
        await asyncio.sleep(0)
        yield Step("q", [1], "x", True, "length", 3, 1, SpecStats())

    async def load(self) -> list[LoopLoad]:
        return self.loads

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _service(s: SharedState, backend: ScriptedBackend, **kw: Any) -> RouterService:
    return RouterService(backend, None, s, BLOCK, policy=RoutingPolicy(seed=0), **kw)  # type: ignore[arg-type]


def _request(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(ids, SamplingParams(max_tokens=1), None, False, False, False)


def test_routing_prefers_the_cached_prefix_then_the_lighter_group(state) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(40))

    async def scenario() -> tuple[Any, ...]:
        s = await state()
        loads = [LoopLoad(3, 0, 0.2), LoopLoad(0, 0, 0.0), LoopLoad(9, 4, 0.9)]
        backend = ScriptedBackend(loads)
        service = _service(s, backend)
        # Nothing cached: two random choices, the lighter wins; never the heaviest group.
        cold = [(await service.choose_group(prompt))[0] for _ in range(8)]
        await s.record_prefix(prompt[:32], BLOCK, "g0")
        warm = await service.choose_group(prompt)
        # The cached group is far busier than the lightest: affinity gives way.
        loads[0] = LoopLoad(12, 3, 0.8)
        service.routing._load_at = 0.0
        busy = await service.choose_group(prompt)
        # A served request records its blocks for the next one.
        steps = [st async for st in service.generate(_request(list(range(500, 520))), "q1")]
        await service.drain()
        after = await s.cached_blocks(list(range(500, 520)), BLOCK, backend.groups)
        await s.close()
        return cold, warm, busy, steps, backend.served, after

    cold, warm, busy, steps, served, after = run(scenario())
    assert 2 not in cold and set(cold) <= {0, 1}
    assert warm == (0, "prefix")
    assert busy[1] == "load" and busy[0] != 0
    assert steps[-1].finished
    assert after[backend_name(served[-1])] == 5  # 20 prompt tokens + 1 output: 5 blocks


def backend_name(index: int) -> str:
    return f"g{index}"


def test_admission_control_and_refusals_before_any_token(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> tuple[Any, ...]:
        s = await state()
        service = _service(s, ScriptedBackend([LoopLoad(0, 0, 0.0)]), max_queue=1)
        first = service.generate(_request([1, 2, 3]), "a")
        step = await anext(first)  # admitted, still open
        with pytest.raises(errors.RouterError) as refused:
            await anext(service.generate(_request([1, 2, 3]), "b"))
        await first.aclose()
        again = [st async for st in service.generate(_request([1, 2, 3]), "c")]
        await service.drain()
        await s.close()
        return step, refused.value, again

    step, refused, again = run(scenario())
    assert step.finished and refused.status == 503 and refused.grpc_code == "UNAVAILABLE"
    assert refused.headers() == {"Retry-After": "1"} and len(again) == 1


def test_shared_ngram_pool_learns_across_requests_through_redis(redis_server) -> None:  # type: ignore[no-untyped-def]
    import redis

    from cluster.ngram_pool import STREAM, PoolFollower, decode, encode
    from workers.drafting.base import DraftRequest
    from workers.drafting.ngram import NgramDrafter, SharedNgramPool

    assert decode(encode([0, 7, 49151, 2**31])) == [0, 7, 49151, 2**31]
    url = f"redis://127.0.0.1:{redis_server.port}/7"
    client = redis.Redis.from_url(url)
    client.flushdb()

    async def publish() -> None:
        import redis.asyncio as aioredis

        s = SharedState(aioredis.Redis.from_url(url))
        await s.share_sequence([10, 11, 12, 13, 14, 15, 16, 17])
        await s.close()

    asyncio.run(publish())  # a router finished a request
    pool = SharedNgramPool(min_n=3, max_n=4, continuation=4)
    follower = PoolFollower(url, None, pool).start()
    try:
        deadline = time.monotonic() + 10
        while pool.sequences < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.sequences == 1 and client.xlen(STREAM) == 1
    finally:
        follower.stop()
    drafter = NgramDrafter()
    params = SamplingParams(max_tokens=8)
    drafter.add("r", [1, 2, 11, 12, 13], params)  # its own tokens hold no repeat
    ask = [DraftRequest("r", 5, 3)]
    assert drafter.propose(ask)["r"].token_ids == []
    drafter.pool = pool
    assert drafter.propose(ask)["r"].token_ids == [14, 15, 16]  # what followed elsewhere
    drafter.add("s", [11, 12, 13, 9, 8, 11, 12, 13], params)
    assert drafter.propose([DraftRequest("s", 8, 3)])["s"].token_ids == [9, 8, 11]  # its own first
    assert pool.lookup([11, 12], 3) == []  # shorter than min_n: too weak to share


def test_shared_ngram_pool_is_bounded() -> None:
    from workers.drafting.ngram import SharedNgramPool

    pool = SharedNgramPool(min_n=2, max_n=2, continuation=2, capacity=5)
    pool.learn(list(range(20)))
    assert len(pool) == 5
    assert pool.lookup([16, 17], 2) == [18, 19] and pool.lookup([1, 2], 2) == []


def test_a_burst_between_load_polls_spreads_over_equal_groups(state) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> list[int]:
        s = await state()
        backend = ScriptedBackend([LoopLoad(2, 0, 0.1), LoopLoad(2, 0, 0.1), LoopLoad(2, 0, 0.1)])
        service = _service(s, backend)
        picks = [(await service.choose_group([7] * 5))[0] for _ in range(30)]  # one poll
        await s.close()
        return [picks.count(g) for g in range(3)]

    assert run(scenario()) == [10, 10, 10]


class FailingBackend:
    """Two groups; group 0 fails after two tokens of any request (`errors.GroupFailed`, as a
    dead actor surfaces), group 1 answers until `max_tokens`, one token a step. Whether group
    0 answers a health check is set by the test."""

    def __init__(self, group0_healthy: bool = False) -> None:
        self.groups = ["g0", "g1"]
        self.group0_healthy = group0_healthy
        self.calls: list[tuple[int, Any]] = []

    async def stream(
        self,
        group: int,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        spec: Any,
        continuation: Any = None,
        share: Any = None,
    ) -> AsyncGenerator[Step, None]:
        self.calls.append((group, continuation))
        done = [] if continuation is None else list(continuation.token_ids)
        stats = SpecStats() if continuation is None else continuation.stats
        while len(done) < params.max_tokens:
            if group == 0 and len(done) == 2:
                raise errors.GroupFailed("verifier g0 is unavailable")
            done.append(100 + len(done))
            stats.record(1, 1)
            last = len(done) == params.max_tokens
            yield Step(
                request_id,
                [done[-1]],
                f"<{done[-1]}>",
                last,
                "length" if last else None,
                len(prompt_ids),
                len(done),
                stats,
            )
            await asyncio.sleep(0)

    async def load(self) -> list[LoopLoad]:
        return [LoopLoad(0, 0, 0.0), LoopLoad(0, 0, 0.0)]

    async def healthy(self, group: int) -> bool:
        return group == 1 or self.group0_healthy

    async def close(self) -> None:
        pass


def test_a_request_whose_group_fails_goes_on_on_another(state) -> None:  # type: ignore[no-untyped-def]
    """Group 0 fails two tokens in: the request goes on on group 1 with those two tokens and
    its statistics, the caller sees one unbroken run, and the registry and metrics say so.
    With no healthy group within `max_wait_s`, or no attempts allowed, the caller gets the
    503 as before."""
    from cluster.config import MigrationSettings

    async def scenario() -> tuple[Any, ...]:
        s = await state()
        backend = FailingBackend()
        service = _service(s, backend)
        request = GenerateRequest(
            [1, 2, 3], SamplingParams(max_tokens=6), None, False, False, False
        )
        steps = [st async for st in service.generate(request, "moved", (0, "test"))]
        await service.drain()
        record = await s.lookup_request("moved")
        moved = service.metrics.migrations.labels("g0", "g1")._value.get()
        refusals = []
        for migration in (MigrationSettings(max_attempts=0), MigrationSettings(max_wait_s=0.0)):
            down = FailingBackend()
            down.healthy = _never  # type: ignore[method-assign]
            refusing = _service(s, down, migration=migration)
            with pytest.raises(errors.GroupFailed) as failed:
                async for _ in refusing.generate(request, f"stuck-{len(refusals)}", (0, "test")):
                    pass
            refusals.append(failed.value.status)
        await s.close()
        return steps, backend.calls, record, moved, refusals

    steps, calls, record, moved, refusals = run(scenario())
    assert [t for st in steps for t in st.new_token_ids] == [100, 101, 102, 103, 104, 105]
    assert "".join(st.text for st in steps) == "<100><101><102><103><104><105>"
    assert steps[-1].finished and steps[-1].num_output_tokens == 6
    assert steps[-1].spec.verify_steps == 6  # each step counted once, across the move
    assert [g for g, _ in calls] == [0, 1] and calls[1][1].token_ids == (100, 101)
    assert record["group"] == "g1" and record["token_ids"] == [100, 101, 102, 103, 104, 105]
    assert record["finish_reason"] == "length" and moved == 1
    assert refusals == [503, 503]


async def _never(group: int) -> bool:
    return False


def test_a_stream_does_not_wait_on_a_redis_that_stopped_answering(state) -> None:  # type: ignore[no-untyped-def]
    """Redis paused (as a host cut off: nothing answers, nothing is closed): the request is
    routed by load once its prefix hints are late, its tokens do not wait on its registry
    writes, and those reach Redis, in order, once it answers again."""
    import redis.asyncio as aioredis

    async def scenario() -> tuple[float, list[Step], dict[str, Any] | None]:
        s = await state()
        service = _service(s, ScriptedBackend([LoopLoad(0, 0, 0.0), LoopLoad(0, 0, 0.0)]))
        pauser = aioredis.Redis(connection_pool=s.redis.connection_pool)
        await pauser.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        t0 = time.perf_counter()
        steps = [st async for st in service.generate(_request([1, 2, 3]), "paused")]
        took = time.perf_counter() - t0
        await service.drain()  # its writes, once Redis answers
        return took, steps, await s.lookup_request("paused")

    took, steps, record = run(scenario())
    assert took < 1.0 and steps[-1].finished
    assert record is not None and record["finish_reason"] == "length"
