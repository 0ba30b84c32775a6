"""Fair share through the API: a request's `priority` (HTTP, and gRPC's field), a key's weight and
default priority, and a priority more urgent than the key allows refused with a 400 naming the
field; what reaches the engine is the key's tenant and weight with the request's priority."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from router.keys import KeyLine
from tests.router.helpers import PROMPT, RunningRouter, post, start_router
from workers.engine.fair_share import Share

pytestmark = pytest.mark.slow

URGENT = "sk-ops-0123456789"  # may ask for priority -10 and up; weight 3
PLAIN = "sk-batch-abcdef"  # priority 5 by default, nothing more urgent than 0


@pytest.fixture(scope="module")
def router(local_engine, checkpoint, redis_server) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    from router.backends import LocalBackend

    keys = [
        KeyLine(URGENT, "ops", options=(("weight", "3"), ("best_priority", "-10"))),
        KeyLine(PLAIN, "batch", options=(("priority", "5"),)),
    ]
    running = start_router(LocalBackend(local_engine), checkpoint.tokenizer, redis_server, 3, keys)
    yield running
    running.stop()


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
