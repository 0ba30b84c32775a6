"""A property-based fuzz (hypothesis) of the HTTP API over a real router and engine: valid
bodies of the fields each endpoint reads, the same with one field of any JSON value (wrong
type, out of range, nested, unknown), any JSON at all, and bytes that are not JSON. No input may
get a 5xx or hang; every refusal is in OpenAI's error format; the router serves a normal
request after each endpoint's batch. `OUTRIDER_FUZZ_EXAMPLES` (default 25 bodies an endpoint,
about two minutes in all) sets the depth; `-s` prints the statuses seen (1,500 bodies were run
once this way, with no server error)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.helpers import MODEL, post


@pytest.fixture(scope="module")
def server(open_router) -> str:  # type: ignore[no-untyped-def]
    return open_router.url


pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("OUTRIDER_FUZZ_EXAMPLES", "25"))  # per endpoint, bounded for CI
SEEN: dict[str, Counter[int]] = {}  # path -> statuses, printed with -s
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["", "user", "assistant", "system", "tool", "json_object", "auto"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | VALUES},
    optional={"content": st.text(max_size=60) | VALUES, "name": VALUES, "tool_calls": VALUES},
)
# The fields each endpoint reads (router/schemas.py), so that most bodies get past the JSON
# parser into validation; a few nonsense keys too.
COMMON = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "min_tokens",
    "ignore_eos",
    "response_format",
    "stop_token_ids",
    "prediction",
    "speculative",
    "zzz_unknown",
]
FIELDS = {
    "/v1/completions": ["prompt", "echo", "suffix", "best_of", "top_logprobs", *COMMON],
    "/v1/chat/completions": [
        "messages",
        "tools",
        "tool_choice",
        "top_logprobs",
        "max_completion_tokens",
        *COMMON,
    ],
    "/v1/responses": [
        "input",
        "instructions",
        "max_output_tokens",
        "previous_response_id",
        "store",
        "text",
        "tools",
        "tool_choice",
        *COMMON,
    ],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "model"],
    "/detokenize": ["tokens", "model"],
}
# Values a field takes in a valid request, drawn three times as often as any JSON value, so
# that many bodies get through validation into tokenizing, templates, sampling and streaming.
TEXT = st.text(max_size=60)
GOOD: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "prompt": TEXT | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": TEXT}), min_size=1, max_size=2
    ),
    "input": TEXT,
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "max_output_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**31),
    "stop": TEXT | st.lists(TEXT, max_size=2),
    "stream": st.booleans(),
    "logprobs": st.integers(0, 5) | st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "echo": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tokens": st.lists(st.integers(0, 49151), max_size=8),
}
NEVER_LONG = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "min_tokens")


def bodies(path: str) -> st.SearchStrategy[Any]:
    """Valid bodies; valid bodies with one field of any value (any field the endpoint reads,
    or an unknown one); any JSON; bytes."""
    fields = FIELDS[path]
    required = {f: GOOD[f] for f in ("prompt", "messages", "input", "tokens") if f in fields}
    if path == "/tokenize":
        required = {}  # a prompt or messages
    optional = {f: GOOD[f] for f in fields if f in GOOD and f not in required}
    good = st.fixed_dictionaries(required, optional=optional)

    def one_wrong(body: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
        return {**body, name: value}

    wrong_value = st.sampled_from(fields).flatmap(
        lambda name: st.tuples(
            st.just(name), st.integers(-3, 3) | SCALARS if name in NEVER_LONG else VALUES
        )
    )
    bent = st.builds(lambda b, nv: one_wrong(b, *nv), good, wrong_value)
    return good | good | bent | bent | VALUES | st.binary(max_size=60)


def check(server: str, path: str, body: Any) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    start = time.monotonic()
    status, parsed, _, _ = post(server + path, data)
    SEEN.setdefault(path, Counter())[status] += 1
    assert status < 500, (path, body, parsed)
    assert time.monotonic() - start < 60, (path, body)
    if status >= 400:
        error = parsed["error"]
        assert isinstance(error["message"], str) and error["message"], parsed
        assert error["type"] and "code" in error, parsed


@pytest.mark.parametrize("path", list(FIELDS))
def test_no_input_gets_a_server_error(server: str, path: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=bodies(path))
    def fuzz(body: Any) -> None:
        check(server, path, body)

    fuzz()
    print(f"{path}: {sum(SEEN[path].values())} bodies, statuses {dict(SEEN[path])}")
    status, parsed, _, _ = post(
        server + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert status == 200 and parsed["choices"][0]["text"], parsed
