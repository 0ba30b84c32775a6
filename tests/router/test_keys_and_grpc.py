"""API keys and rate limits shared by two router replicas through one real Redis, and the gRPC
API (a client built from the .proto) with its health service and status codes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.keys import KeyLine
from tests.router.helpers import MODEL, PROMPT, RunningRouter, get, post, start_router

grpc = pytest.importorskip("grpc")
pytestmark = pytest.mark.slow

LIMITED = "sk-limited-0123456789"
OPEN = "sk-roomy-abcdef"


@pytest.fixture(scope="module")
def replicas(local_engine, checkpoint, redis_server) -> Iterator[list[RunningRouter]]:  # type: ignore[no-untyped-def]
    """Two routers over the same engine and the same Redis database; keys from a keys file:
    one limited to 3 requests then 0.5 per second, one effectively unlimited."""
    from router.backends import LocalBackend

    keys = [KeyLine(LIMITED, "limited", 0.5, 3), KeyLine(OPEN, "roomy", 1000.0, 1000)]
    running = [
        start_router(LocalBackend(local_engine), checkpoint.tokenizer, redis_server, 2, keys)
        for _ in range(2)
    ]
    yield running
    for r in running:
        r.stop()


def test_missing_and_wrong_keys_get_401(replicas) -> None:  # type: ignore[no-untyped-def]
    url = replicas[0].url + "/v1/completions"
    for key, message in ((None, "missing API key"), ("sk-wrong", "invalid API key")):
        code, out, _, _ = post(url, {"prompt": PROMPT, "max_tokens": 1}, key)
        assert code == 401 and message in out["error"]["message"]
        assert out["error"]["type"] == "authentication_error"
    assert get(replicas[1].url + "/v1/models")[0] == 401
    assert get(replicas[1].url + "/v1/models", OPEN)[0] == 200
    assert get(replicas[1].url + "/health")[0] == 200  # probes need no key


def test_keys_are_stored_hashed(replicas) -> None:  # type: ignore[no-untyped-def]
    import redis

    client = redis.Redis.from_url(replicas[0].redis_url)
    dump = json.dumps({k.decode(): v.decode() for k, v in client.hgetall("outrider:keys").items()})
    assert LIMITED not in dump and OPEN not in dump
    assert len(client.hkeys("outrider:keys")) == 2


def test_two_replicas_share_one_rate_limit(replicas) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT, "max_tokens": 1}
    # The engine's first request warms it up (seconds); the bucket refills meanwhile.
    assert post(replicas[0].url + "/v1/completions", body, OPEN)[0] == 200
    codes = []
    for i in range(4):  # alternate replicas: one bucket of 3 for the key, not 3 per replica
        code, out, _, headers = post(replicas[i % 2].url + "/v1/completions", body, LIMITED)
        codes.append(code)
    assert codes == [200, 200, 200, 429]
    assert out["error"]["type"] == "rate_limit_error"
    assert 1 <= int(headers["retry-after"]) <= 2
    # Another key has its own bucket.
    assert post(replicas[1].url + "/v1/completions", body, OPEN)[0] == 200
    time.sleep(2.1)  # refills at 0.5/s: one more request
    assert post(replicas[1].url + "/v1/completions", body, LIMITED)[0] == 200
    assert post(replicas[0].url + "/v1/completions", body, LIMITED)[0] == 429


def _stub(port: int) -> Any:
    from router.proto import generate_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return generate_pb2_grpc.GenerationStub(channel), channel


def test_grpc_streams_the_same_tokens_as_http(replicas) -> None:  # type: ignore[no-untyped-def]
    from router.proto import generate_pb2

    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    _, whole, _, _ = post(replicas[0].url + "/v1/completions", body, OPEN)
    stub, channel = _stub(replicas[1].grpc_port)
    with channel:
        request = generate_pb2.GenerateRequest(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0
        )
        responses = list(stub.Generate(request, metadata=[("authorization", f"Bearer {OPEN}")]))
        assert "".join(r.text for r in responses) == whole["choices"][0]["text"]
        assert responses[-1].finished and responses[-1].finish_reason == "length"
        assert sum(len(r.token_ids) for r in responses) == 12
        usage = responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (5, 12)
        assert usage.speculative.verify_steps == 11
        chat = generate_pb2.GenerateRequest(
            chat=generate_pb2.ChatMessages(
                messages=[generate_pb2.ChatMessage(role="user", content="Name a colour.")]
            ),
            max_tokens=6,
            temperature=0.0,
            speculative=generate_pb2.SpeculativeOptions(method="ngram"),
        )
        chat_text = "".join(
            r.text for r in stub.Generate(chat, metadata=[("authorization", f"Bearer {OPEN}")])
        )
        http_chat = post(
            replicas[0].url + "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Name a colour."}],
                "max_tokens": 6,
                "temperature": 0,
            },
            OPEN,
        )[1]
        assert chat_text == http_chat["choices"][0]["message"]["content"]
        # The conversation's prompt is in the prefix cache now.
        *_, last = stub.Generate(chat, metadata=[("authorization", f"Bearer {OPEN}")])
        assert 0 < last.usage.cached_prompt_tokens < last.usage.prompt_tokens
        with_logprobs = generate_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=2
        )
        steps = list(stub.Generate(with_logprobs, metadata=[("authorization", f"Bearer {OPEN}")]))
        assert all(len(r.logprobs) == len(r.token_ids) for r in steps)
        grpc_logprobs = [lp for r in steps for lp in r.logprobs]
        assert [lp.token_id for lp in grpc_logprobs] == [t for r in steps for t in r.token_ids]
        assert all([t.token_id for t in lp.top][:1] == [lp.token_id] for lp in grpc_logprobs)
        http_logprobs = post(
            replicas[0].url + "/v1/completions", {**body, "max_tokens": 5, "logprobs": 2}, OPEN
        )[1]["choices"][0]["logprobs"]
        assert [lp.logprob for lp in grpc_logprobs] == pytest.approx(
            http_logprobs["token_logprobs"], abs=1e-4
        )
        assert all(len(lp.top) == 2 for lp in grpc_logprobs)
        structured = {"max_tokens": 12, "temperature": 0, "guided_choice": [" Paris", " Rome"]}
        http_choice = post(replicas[0].url + "/v1/completions", {**body, **structured}, OPEN)[1]
        pb_structured = generate_pb2.StructuredOutput(
            choice=generate_pb2.StructuredOutput.Choices(choices=[" Paris", " Rome"])
        )
        one_of = generate_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=12, temperature=0.0, structured_output=pb_structured
        )
        steps = list(stub.Generate(one_of, metadata=[("authorization", f"Bearer {OPEN}")]))
        assert "".join(r.text for r in steps) == http_choice["choices"][0]["text"] == " Paris"
        assert steps[-1].finish_reason == "stop"
        # vLLM's allowed_token_ids, bad_words, include_stop_str_in_output, truncate_prompt_tokens
        vllm = {
            "allowed_token_ids": [11, 12, 13],
            "bad_words": ["the"],
            "include_stop_str_in_output": True,
            "truncate_prompt_tokens": 3,
            "stop": ["\n"],
        }
        http_vllm = post(replicas[0].url + "/v1/completions", {**body, **vllm}, OPEN)[1]
        extras = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=0.0, **vllm)
        steps = list(stub.Generate(extras, metadata=[("authorization", f"Bearer {OPEN}")]))
        assert {t for r in steps for t in r.token_ids} <= {11, 12, 13}
        assert "".join(r.text for r in steps) == http_vllm["choices"][0]["text"]
        assert steps[-1].usage.prompt_tokens == 3 == http_vllm["usage"]["prompt_tokens"]
        models = stub.ListModels(
            generate_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {OPEN}")]
        )
        assert list(models.models) == [MODEL]


@pytest.mark.parametrize(
    ("fields", "key", "code", "message"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, OPEN, "INVALID_ARGUMENT", "max_tokens"),
        ({"prompt": PROMPT, "top_p": 1.5}, OPEN, "INVALID_ARGUMENT", "top_p"),
        ({"prompt": "word " * 400}, OPEN, "INVALID_ARGUMENT", "maximum context length"),
        ({"prompt": PROMPT, "model": "gpt-4"}, OPEN, "NOT_FOUND", "does not exist"),
        (
            {"prompt": PROMPT, "structured_output": {"regex": "(ab"}},
            OPEN,
            "INVALID_ARGUMENT",
            "invalid regex",
        ),
        ({"prompt": PROMPT}, None, "UNAUTHENTICATED", "missing API key"),
        ({"prompt": PROMPT}, "sk-nope", "UNAUTHENTICATED", "invalid API key"),
    ],
)
def test_grpc_refusals_have_status_codes(replicas, fields, key, code, message) -> None:  # type: ignore[no-untyped-def]
    from router.proto import generate_pb2

    stub, channel = _stub(replicas[0].grpc_port)
    metadata = [] if key is None else [("authorization", f"Bearer {key}")]
    with channel, pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate_pb2.GenerateRequest(**fields), metadata=metadata))
    assert err.value.code() == getattr(grpc.StatusCode, code)
    assert message in err.value.details()


def test_grpc_rate_limit_is_resource_exhausted_and_health_serves(replicas) -> None:  # type: ignore[no-untyped-def]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from router.proto import generate_pb2

    stub, channel = _stub(replicas[0].grpc_port)
    request = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=1)
    metadata = [("authorization", f"Bearer {LIMITED}")]
    with channel:
        codes = []
        for _ in range(5):
            try:
                list(stub.Generate(request, metadata=metadata))
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
                trailers = dict(exc.trailing_metadata() or ())
        assert "RESOURCE_EXHAUSTED" in codes and "retry-after" in trailers
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "outrider.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
