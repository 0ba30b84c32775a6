"""Fair share through the API: a request's `priority` (HTTP, and gRPC's field), a key's weight and
default priority, and a priority more urgent than the key allows refused with a 400 naming the
field; what reaches the engine is the key's tenant and weight with the request's priority."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.keys import KeyLine
from tests.router.helpers import PROMPT, RunningRouter, post, raw_completion_stream, start_router
from workers.engine.fair_share import Share

pytestmark = pytest.mark.slow

URGENT = "sk-ops-0123456789"  # may ask for priority -10 and up; weight 3
PLAIN = "sk-batch-abcdef"  # priority 5 by default, nothing more urgent than 0
FOUR = "sk-four-at-once"  # 4 concurrent requests over all replicas
LEASE_S = 1.5


@pytest.fixture(scope="module")
def replicas(local_engine, checkpoint, redis_server) -> Iterator[list[RunningRouter]]:  # type: ignore[no-untyped-def]
    """Two router replicas over one engine and one Redis database."""
    from router.backends import LocalBackend

    keys = [
        KeyLine(URGENT, "ops", options=(("weight", "3"), ("best_priority", "-10"))),
        KeyLine(PLAIN, "batch", options=(("priority", "5"),)),
        KeyLine(FOUR, "four", options=(("max_concurrent", "4"),)),
    ]
    backend = LocalBackend(local_engine)
    running = [
        start_router(backend, checkpoint.tokenizer, redis_server, 3, keys, lease_s=LEASE_S)
        for _ in range(2)
    ]
    yield running
    for r in running:
        r.stop()


@pytest.fixture
def router(replicas) -> RunningRouter:  # type: ignore[no-untyped-def]
    return replicas[0]


@pytest.fixture
def shares(local_engine, monkeypatch: pytest.MonkeyPatch) -> list[Share]:  # type: ignore[no-untyped-def]
    """The shares the engine's requests arrive with."""
    seen: list[Share] = []
    add = local_engine.engine.add_request

    def spy(*args: Any, share: Share, **kwargs: Any) -> None:
        seen.append(share)
        add(*args, share=share, **kwargs)

    monkeypatch.setattr(local_engine.engine, "add_request", spy)
    return seen


def complete(router: RunningRouter, key: str, **fields: object) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}
    code, out, _, _ = post(router.url + "/v1/completions", body, key)
    return code, out


def test_the_key_sets_tenant_weight_and_default_priority(router, shares) -> None:  # type: ignore[no-untyped-def]
    assert complete(router, URGENT, priority=-10)[0] == 200
    assert complete(router, PLAIN)[0] == 200
    assert complete(router, PLAIN, priority=9)[0] == 200  # less urgent is always allowed
    assert shares == [Share("ops", 3.0, -10), Share("batch", 1.0, 5), Share("batch", 1.0, 9)]


@pytest.mark.parametrize(
    ("key", "priority", "message"),
    [
        (PLAIN, -1, "more urgent than this API key may ask for (at most 0"),
        (URGENT, -11, "at most -10"),
        (URGENT, 5000, "less than or equal to 1000"),
        (URGENT, "high", "valid integer"),
    ],
)
def test_a_priority_the_key_may_not_ask_for_is_a_400(  # type: ignore[no-untyped-def]
    router, key: str, priority: object, message: str
) -> None:
    code, out = complete(router, key, priority=priority)
    assert code == 400 and message in out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["param"] == "priority"


def test_chat_takes_a_priority_too(router, shares) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3}
    code, _, _, _ = post(router.url + "/v1/chat/completions", body, URGENT)
    assert code == 200 and shares == [Share("ops", 3.0, -3)]


def test_a_keys_concurrency_holds_over_replicas(replicas) -> None:  # type: ignore[no-untyped-def]
    """Four long streams, two on each replica, hold the key's four places: a fifth is refused
    on either replica; once one ends, a new one gets in."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with contextlib.ExitStack() as streams:
        socks = [
            streams.enter_context(raw_completion_stream(replicas[i % 2].port, body, key=FOUR))
            for i in range(4)
        ]
        for sock in socks:  # each has its first bytes: admitted
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        for r in replicas:
            code, out = complete(r, FOUR)
            assert code == 429 and "concurrent" in out["error"]["message"]
        socks[0].close()  # the client leaves: its place is given back
        deadline = time.monotonic() + 10
        while complete(replicas[1], FOUR)[0] != 200:
            assert time.monotonic() < deadline, "the place never came back"
            time.sleep(0.2)


def test_a_dead_replicas_leases_lapse(replicas) -> None:  # type: ignore[no-untyped-def]
    """Leases nobody renews (their replica died) stop counting after their lease time."""
    import redis.asyncio as aioredis

    from router.keys import KeyLimits, KeyLine
    from router.state import SharedState

    key = KeyLine("sk-x", "x").api_key(KeyLimits(max_concurrent=2))

    async def scenario() -> list[bool]:
        state = SharedState(aioredis.Redis.from_url(replicas[0].redis_url))
        try:
            taken = [await state.take_lease(key, f"dead:{i}", LEASE_S) for i in range(3)]
            await asyncio.sleep(LEASE_S + 0.3)
            taken.append(await state.take_lease(key, "alive:0", LEASE_S))
            return taken
        finally:
            await state.close()

    assert asyncio.run(scenario()) == [True, True, False, True]
