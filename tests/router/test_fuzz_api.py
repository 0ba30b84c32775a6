"""A property-based fuzz (hypothesis) of the HTTP and gRPC APIs over a real router and engine.

HTTP: bodies valid under each endpoint's schema in the router's own OpenAPI document (drawn
from it), valid bodies of the fields each endpoint reads, the same with one field of any JSON
value (wrong type, out of range, nested, unknown), any JSON at all, and bytes that are not JSON.
gRPC (`Generate`): messages built from the proto's descriptors (any value of each field's type),
valid ones with one field of any value, and bytes that are no message. No input may get a 5xx
(gRPC: INTERNAL or UNKNOWN) or hang; every refusal is in OpenAI's error format (gRPC: a status
with a message); the router serves a normal request after each batch.
`OUTRIDER_FUZZ_EXAMPLES` (default 25 bodies an HTTP endpoint and 50 gRPC requests, about 75 s
in all) sets the depth; `-s` prints the statuses seen. At 300 (1,500 HTTP bodies and 600 gRPC
requests, run once) there was no server error: 465 bodies and 209 requests were served, the
rest refused with 400/404 and INVALID_ARGUMENT/NOT_FOUND."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.helpers import MODEL, get, post


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
NEVER_LONG = (
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "min_tokens",
)


def schema_bodies(openapi: dict[str, Any], path: str) -> st.SearchStrategy[Any]:
    """Bodies valid under the endpoint's request schema in the router's own OpenAPI document,
    with the fields that set how long an answer runs capped at 3."""
    body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    valid = from_json_schema(body["schema"], _capped(openapi))
    # The schema cannot say which model is served: a body naming another is a 404.
    return valid.map(lambda b: {**b, "model": MODEL} if "model" in b else b)


def from_json_schema(schema: dict[str, Any], root: dict[str, Any], depth: int = 0) -> Any:
    """Values valid under `schema` (the JSON Schema pydantic writes: refs into `root`, anyOf,
    enum, const, typed scalars with bounds, arrays, objects with required and optional keys)."""
    if depth > 24:  # a recursive schema: cut it off (with a value it may refuse)
        return st.none()
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return from_json_schema(target, root, depth + 1)
    if "anyOf" in schema or "oneOf" in schema:
        branches = schema.get("anyOf") or schema["oneOf"]
        return st.one_of([from_json_schema(b, root, depth + 1) for b in branches])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return VALUES
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**31) - 1) + 1)
        high = schema.get("maximum", schema.get("exclusiveMaximum", 2**31 + 1) - 1)
        return st.integers(low, high)
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            allow_nan=False,
            allow_infinity=False,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
        )
    if kind == "string":
        return st.text(
            min_size=schema.get("minLength", 0), max_size=min(40, schema.get("maxLength", 40))
        )
    if kind == "array":
        items = from_json_schema(schema.get("items", {}), root, depth + 1)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(4, schema.get("maxItems", 4))))
    properties = {
        name: from_json_schema(prop, root, depth + 1)
        for name, prop in schema.get("properties", {}).items()
    }
    required = {name: properties.pop(name) for name in schema.get("required", [])}
    extra = schema.get("additionalProperties")
    if not properties and not required and isinstance(extra, dict):
        return st.dictionaries(
            st.text(max_size=8), from_json_schema(extra, root, depth + 1), max_size=3
        )
    return st.fixed_dictionaries(required, optional=properties)


def _capped(schema: Any) -> Any:
    """`schema` with every integer property named in NEVER_LONG at most 3."""
    if isinstance(schema, list):
        return [_capped(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _capped(v) for k, v in schema.items()}
    properties = out.get("properties")
    if isinstance(properties, dict):
        for name, prop in properties.items():
            if name in NEVER_LONG and isinstance(prop, dict):
                properties[name] = _cap(prop)
    return out


def _cap(prop: dict[str, Any]) -> dict[str, Any]:
    if prop.get("type") == "integer":
        return {**prop, "maximum": min(3, prop.get("maximum", 3))}
    return {**prop, **{k: [_cap(b) for b in prop[k]] for k in ("anyOf", "oneOf") if k in prop}}


def bodies(path: str, openapi: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Bodies valid under the endpoint's OpenAPI schema; valid bodies of the fields it reads;
    those with one field of any value (any field the endpoint reads, or an unknown one); any
    JSON; bytes."""
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
    valid = schema_bodies(openapi, path)
    return good | valid | bent | good | VALUES | st.binary(max_size=60)


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


@pytest.fixture(scope="module")
def openapi(server: str) -> dict[str, Any]:
    """The router's own OpenAPI document, as it serves it."""
    status, document = get(server + "/openapi.json")
    assert status == 200
    return dict(document)


@pytest.mark.parametrize("path", list(FIELDS))
def test_no_input_gets_a_server_error(server: str, openapi: dict[str, Any], path: str) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=bodies(path, openapi))
    def fuzz(body: Any) -> None:
        check(server, path, body)

    fuzz()
    print(f"{path}: {sum(SEEN[path].values())} bodies, statuses {dict(SEEN[path])}")
    status, parsed, _, _ = post(
        server + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert status == 200 and parsed["choices"][0]["text"], parsed


# The gRPC service, fuzzed from its proto: messages built field by field from the descriptors
# (every field's type over its whole range, nested messages, oneofs, repeated and map fields),
# and bytes that are no message at all.
GRPC_SMALL = {"max_tokens": st.integers(0, 3) | st.integers(2**20, 2**32 - 1)}
INT_RANGES = {
    "TYPE_INT32": (-(2**31), 2**31 - 1),
    "TYPE_INT64": (-(2**63), 2**63 - 1),
    "TYPE_UINT32": (0, 2**32 - 1),
    "TYPE_UINT64": (0, 2**64 - 1),
}
WORDS = ["", "user", "assistant", "system", "ngram", "eagle", "suffix", "draft_model", "none"]


def field_values(field: Any, depth: int) -> st.SearchStrategy[Any]:
    """Any value of one field's type (a list or dict for repeated and map fields)."""
    from google.protobuf.descriptor import FieldDescriptor

    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return st.dictionaries(scalar_values(key), scalar_values(value), max_size=3)
    one = (
        message_values(field.message_type, depth + 1)
        if field.type == FieldDescriptor.TYPE_MESSAGE
        else GRPC_SMALL[field.name]
        if field.name in GRPC_SMALL
        else scalar_values(field)
    )
    if field.is_repeated:
        return st.lists(one, max_size=4)
    return one


def scalar_values(field: Any) -> st.SearchStrategy[Any]:
    from google.protobuf.descriptor import FieldDescriptor

    kind = next(
        n
        for n in dir(FieldDescriptor)
        if n.startswith("TYPE_") and getattr(FieldDescriptor, n) == field.type
    )
    if kind in INT_RANGES:
        lo, hi = INT_RANGES[kind]
        return st.integers(max(lo, -3), min(hi, 60)) | st.integers(lo, hi)
    if kind in ("TYPE_FLOAT", "TYPE_DOUBLE"):
        return st.floats(
            allow_nan=True, allow_infinity=True, width=32 if kind == "TYPE_FLOAT" else 64
        )
    if kind == "TYPE_BOOL":
        return st.booleans()
    if kind == "TYPE_STRING":
        return st.text(max_size=40) | st.sampled_from(WORDS)
    return st.binary(max_size=20)


def message_values(descriptor: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """A message of `descriptor`'s type with any subset of its fields set to any values."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    required = (
        {"max_tokens": GRPC_SMALL["max_tokens"]} if descriptor.name == "GenerateRequest" else {}
    )
    optional = {f.name: field_values(f, depth) for f in descriptor.fields if f.name not in required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))


def grpc_requests() -> st.SearchStrategy[Any]:
    """Valid requests; valid ones with one field of any value of its type; any message; bytes."""
    from router.proto import generate_pb2

    descriptor = generate_pb2.GenerateRequest.DESCRIPTOR
    cls = generate_pb2.GenerateRequest
    good_fields = {
        "temperature": st.floats(0, 2, width=32),
        "top_p": st.floats(0, 1, width=32, exclude_min=True),
        "top_k": st.integers(-1, 50),
        "seed": st.integers(0, 2**31),
        "stop": st.lists(TEXT, max_size=2),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 5),
        "min_tokens": st.integers(0, 2),
    }
    good = st.fixed_dictionaries(
        {"prompt": TEXT, "max_tokens": st.integers(1, 3)}, optional=good_fields
    )
    one_field = st.sampled_from(list(descriptor.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), field_values(f, 1))
    )
    bent = st.builds(lambda kw, nv: {**kw, nv[0]: nv[1]}, good, one_field)
    messages = (good | good | bent | bent).map(lambda kw: cls(**kw))
    return messages | message_values(descriptor) | st.binary(max_size=60)


def test_no_grpc_request_gets_an_internal_error(open_router) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    seen: Counter[str] = Counter()
    with grpc.insecure_channel(f"127.0.0.1:{open_router.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        raw = channel.unary_stream("/outrider.v1.Generation/Generate")

        @settings(
            max_examples=EXAMPLES * 2,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(request=grpc_requests())
        def fuzz(request: Any) -> None:
            call = (
                raw(request, timeout=60)
                if isinstance(request, bytes)
                else stub.Generate(request, timeout=60)
            )
            try:
                for _ in call:
                    pass
            except grpc.RpcError as err:
                code = err.code()
                seen[code.name] += 1
                wrong = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
                assert code not in (*wrong, grpc.StatusCode.DEADLINE_EXCEEDED), err
                assert err.details(), err
                return
            seen["OK"] += 1

        fuzz()
        print(f"gRPC Generate: {sum(seen.values())} requests, statuses {dict(seen)}")
        request = generate_pb2.GenerateRequest(prompt="Hello", max_tokens=2, temperature=0.0)
        assert "".join(r.text for r in stub.Generate(request))
