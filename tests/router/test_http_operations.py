"""Operating the HTTP API (as test_http_api.py serves it): the request registry in Redis, the
operations endpoints, admission control, the shared n-gram pool, a log line per request,
probes under load, and a Redis outage without API keys."""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.router.helpers import (
    MODEL,
    PROMPT,
    get,
    post,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_registry_reports_a_request_from_redis(open_router) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}  # greedy: no early EOS
    _, out, _, _ = post(open_router.url + "/v1/completions", body)
    open_router.service  # noqa: B018 - the service exists once started
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        code, record = get(f"{open_router.url}/v1/requests/{out['id']}")
        if code == 200 and record["state"] == "finished":
            break
        time.sleep(0.05)
    assert record["group"] == "local" and record["prompt_tokens"] == 5
    assert len(record["token_ids"]) == 5 and record["finish_reason"] == "length"
    code, missing = get(f"{open_router.url}/v1/requests/nope")
    assert code == 404 and "nope" in missing["error"]["message"]


def test_operations_endpoints(server: str) -> None:
    assert get(server + "/health") == (200, {"status": "ok"})
    code, version = get(server + "/version")
    assert code == 200 and version["version"] == importlib.metadata.version("outrider")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    card = client.models.retrieve(MODEL)
    assert (card.id, card.model_extra["max_model_len"]) == (MODEL, 256)
    assert client.models.list().data == [card]
    code, out = get(server + "/v1/models/gpt-4")
    assert (code, out["error"]["param"]) == (404, "model")
    assert get(server + "/ready") == (200, {"status": "ready", "redis": True})
    code, text = get(server + "/metrics")
    assert code == 200
    for name in (
        "outrider_requests_total",
        "outrider_time_to_first_token_seconds_bucket",
        "outrider_inter_token_latency_seconds_bucket",
        "outrider_spec_draft_tokens_total",
        'outrider_verifier_queue_depth{group="local"}',
        'outrider_verifier_kv_usage{group="local"}',
    ):
        assert name in text, name
    code, doc = get(server + "/openapi.json")
    assert code == 200
    paths = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/ready", "/tokenize"}
    assert paths <= set(doc["paths"])
    assert "tools" in doc["components"]["schemas"]["TokenizeRequest"]["properties"]
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "speculative"} <= set(schema["properties"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")


def test_admission_control_refuses_beyond_the_queue(local_engine, checkpoint, redis_server) -> None:  # type: ignore[no-untyped-def]
    from router.backends import LocalBackend
    from tests.router.helpers import start_router

    running = start_router(
        LocalBackend(local_engine), checkpoint.tokenizer, redis_server, db=3, max_queue=1
    )
    try:
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
        long = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"}
        )
        first = conn.getresponse()
        assert first.status == 200
        assert first.read(6) == b"data: "  # the stream is open: the request is admitted
        code, out, _, headers = post(running.url + "/v1/completions", {"prompt": PROMPT})
        assert code == 503 and out["error"]["type"] == "service_unavailable"
        assert headers["retry-after"] == "1"
        first.read()
        conn.close()
        assert post(running.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
        # Choices count one each: the second of a batch is refused, and the first is aborted.
        engine = local_engine.engine
        batch = {"prompt": [PROMPT, "Once upon a time"], "max_tokens": 240, "ignore_eos": True}
        batch["speculative"] = {"enabled": False}  # one fp32 forward a token: many seconds
        code, out, _, _ = post(running.url + "/v1/completions", batch)
        assert code == 503 and "requests in flight" in out["error"]["message"]
        deadline = time.monotonic() + 3
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
        assert engine.allocator.num_free_blocks == engine.config.kv_blocks
        assert running.service.in_flight == 0
    finally:
        running.stop()


def test_ngram_drafting_learns_from_earlier_requests_through_redis(server, local_engine) -> None:  # type: ignore[no-untyped-def]
    pool = local_engine.engine.speculator.drafters["ngram"].pool
    body = {
        "messages": [{"role": "user", "content": "Describe the history of the bicycle."}],
        "max_tokens": 24,
        "temperature": 0,
        "speculative": {"method": "ngram", "num_speculative_tokens": 4},
    }
    learned = pool.sequences
    _, first, _, _ = post(server + "/v1/chat/completions", body)
    deadline = time.monotonic() + 10
    while pool.sequences == learned and time.monotonic() < deadline:
        time.sleep(0.02)
    _, second, _, _ = post(server + "/v1/chat/completions", body)
    text = second["choices"][0]["message"]["content"]
    assert text == first["choices"][0]["message"]["content"]  # drafts never change the output
    before, after = first["usage"]["speculative"], second["usage"]["speculative"]
    assert after["accepted"] >= 12 and after["accepted"] > before["accepted"]


def test_a_log_line_per_finished_request(server: str, caplog: pytest.LogCaptureFixture) -> None:
    """One structured line for each request the router finished (numbers as fields), and for a
    refused one; each names the request's id, which the client saw in X-Request-Id."""
    import logging

    caplog.set_level(logging.INFO, logger="outrider.requests")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    code, out, _, headers = post(f"{server}/v1/completions", body)
    assert code == 200
    code, _, _, _ = post(f"{server}/v1/completions", {**body, "max_tokens": -1})
    assert code == 400
    deadline = time.monotonic() + 10  # the router's thread logs as the response goes out
    while len([r for r in caplog.records if r.name == "outrider.requests"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    served, refused = [r.fields for r in caplog.records if r.name == "outrider.requests"][:2]
    assert served["request_id"] == headers["x-request-id"] == out["id"]
    assert served["api"] == "completions" and served["outcome"] == "ok"
    assert served["finish_reason"] == "length" and served["output_tokens"] == 6
    assert served["prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert 0 < served["ttft_ms"] <= served["latency_ms"]
    assert served["verify_steps"] >= 1 and served["group"] and served["routed_by"]
    assert refused["outcome"] == "refused" and refused["status"] == 400
    assert refused["api"] == "completions" and "max_tokens" in refused["error"]


def test_probes_answer_while_large_prompts_are_tokenized(server: str) -> None:
    """Two 2 MB prompts arrive together (refused once tokenized: far past the context). They
    are parsed and tokenized off the event loop, so /health keeps answering meanwhile."""
    big = {"model": MODEL, "prompt": "word " * 400_000, "max_tokens": 4}
    answers: list[tuple[int, Any, str, dict[str, str]]] = []
    senders = [
        threading.Thread(target=lambda: answers.append(post(f"{server}/v1/completions", big)))
        for _ in range(2)
    ]
    for sender in senders:
        sender.start()
    waits = []
    while any(sender.is_alive() for sender in senders):
        start = time.perf_counter()
        assert get(f"{server}/health")[0] == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.01)
    assert [code for code, *_ in answers] == [400, 400]
    assert all("context" in body["error"]["message"] for _, body, *_ in answers)
    assert len(waits) >= 10  # probed all along
    # Under 50 ms on the 2-core VM; the loop held by the tokenizer made one probe wait 0.7 s.
    assert sorted(waits)[len(waits) // 2] < 0.05 and max(waits) < 0.25, sorted(waits)[-3:]


def test_without_api_keys_requests_are_served_through_a_redis_outage(
    local_engine, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """Redis dies: a router without API keys goes on serving (ready says degraded, the
    registry is out of reach, metrics count it), one with keys refuses as before (HTTP 503,
    gRPC UNAVAILABLE, not ready); Redis comes back: the registry catches up on what was served
    meanwhile, and the keyed router writes its key mirror back into the new, empty Redis."""
    import os
    import signal

    import grpc

    from router.backends import LocalBackend
    from router.keys import KeyLine, key_digest
    from router.proto import generate_pb2, generate_pb2_grpc
    from router.redis_server import EmbeddedRedis
    from tests.router.helpers import start_router

    redis = EmbeddedRedis(restart=False).start()
    backend = LocalBackend(local_engine)
    routers: list[Any] = []
    back: EmbeddedRedis | None = None
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    try:
        routers.append(start_router(backend, checkpoint.tokenizer, redis, db=0))
        key = KeyLine("k1", "a", None, None)
        routers.append(start_router(backend, checkpoint.tokenizer, redis, db=1, keys=[key]))
        open_, keyed = routers
        code, before, _, _ = post(open_.url + "/v1/completions", body)
        assert code == 200 and post(keyed.url + "/v1/completions", body, key="k1")[0] == 200
        assert redis.pid is not None
        os.kill(redis.pid, signal.SIGKILL)
        code, during, _, headers = post(open_.url + "/v1/completions", body)
        assert code == 200, during
        assert during["choices"][0]["text"] == before["choices"][0]["text"]
        request_id = headers["x-request-id"]
        assert get(open_.url + "/ready") == (200, {"status": "degraded", "redis": False})
        assert get(f"{open_.url}/v1/requests/{request_id}")[0] == 503  # the registry is out
        code, refused, _, _ = post(keyed.url + "/v1/completions", body, key="k1")
        assert code == 503 and "Redis" in refused["error"]["message"]
        assert get(keyed.url + "/ready")[0] == 503 and get(keyed.url + "/health")[0] == 200
        with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                request = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=2)
                list(stub.Generate(request, metadata=[("authorization", "Bearer k1")]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        metrics = urllib.request.urlopen(open_.url + "/metrics").read().decode()
        assert "outrider_degraded_requests_total 1.0" in metrics
        assert "outrider_redis_up 0.0" in metrics
        back = EmbeddedRedis(port=redis.port, restart=False).start()
        deadline = time.monotonic() + 20
        record: Any = {}
        while time.monotonic() < deadline and record.get("state") != "finished":
            time.sleep(0.2)
            code, record = get(f"{open_.url}/v1/requests/{request_id}")
        assert record["state"] == "finished" and record["finish_reason"] == "length"
        assert len(record["token_ids"]) == 8  # caught up: what was served while Redis was out
        assert get(open_.url + "/ready") == (200, {"status": "ready", "redis": True})
        # The keyed router wrote its key mirror back into the new (empty) Redis.
        import redis as redis_sync

        mirror = redis_sync.Redis(port=redis.port, db=1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not mirror.hkeys("outrider:keys"):
            time.sleep(0.2)
        assert mirror.hkeys("outrider:keys") == [key_digest("k1").encode()]
        assert post(keyed.url + "/v1/completions", body)[0] == 401
        assert post(keyed.url + "/v1/completions", body, key="k1")[0] == 200
    finally:
        for running in routers:
            running.stop()
        for server in (back, redis):
            if server is not None:
                server.stop()
