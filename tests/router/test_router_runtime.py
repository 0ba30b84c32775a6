"""The router over the real Ray runtime (two verifier groups and a prefill worker on a local Ray
cluster), real Redis and real HTTP/gRPC servers on loopback: the official `openai` client gets
exactly what `outrider generate` prints, gRPC streams the same tokens, a repeated prefix goes
back to the group that cached it, and a client that leaves mid-stream frees its KV blocks in
the verifier, and a stream whose verifier dies goes on on the other group without the client
seeing it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.common import wait_restarted
from tests.router.helpers import (
    MODEL,
    RunningRouter,
    get,
    group_of,
    leave_mid_stream,
    migration_count,
    post,
    raw_completion_stream,
    record_when_finished,
    routed_counts,
    small_workload,
    sse_events,
    start_router,
)
from tests.router.test_http_choices import BAD

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
QUESTION = "What is the capital of France?"
SYSTEM = "You answer in one short sentence. " * 6  # a shared prefix over several KV blocks


@pytest.fixture(scope="module")
def runtime() -> Iterator[Any]:
    from cluster.config import from_dict
    from cluster.runtime import Runtime

    config = from_dict(
        {
            "dtype": "float32",
            "quantization": "none",  # float weights: the fp32 oracle's own tokens
            "engine": {"max_model_len": 512},
            # A fixed k: a seeded sampled request then draws the same on either group (adaptive
            # k follows each group's own measured costs), which the migration tests compare.
            "speculative": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
            "pools": {
                "prefill": {"replicas": 1, "min_remote_prompt_tokens": 24},
                "verifier": {"groups": 2, "resources": {"cpus": 1}},
                "drafter": {"replicas": 0},
            },
            "telemetry": {"exporter": "memory"},
        }
    )
    started = Runtime.start(config, num_cpus=4)
    yield started
    started.shutdown()


def runtime_router(runtime, checkpoint, redis_server, db: int, **options) -> RunningRouter:  # type: ignore[no-untyped-def]
    """A router replica over the runtime's pools (which outlive it)."""
    from router.backends import RuntimeBackend

    backend = RuntimeBackend(runtime, shutdown_on_close=False)
    return start_router(
        backend, checkpoint.tokenizer, redis_server, db=db, max_model_len=512, **options
    )


@pytest.fixture(scope="module")
def router(runtime, checkpoint, redis_server) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    running = runtime_router(runtime, checkpoint, redis_server, db=6)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def router_b(runtime, checkpoint, redis_server) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    """A second replica over the same pools and the same Redis database as `router`."""
    running = runtime_router(runtime, checkpoint, redis_server, db=6)
    yield running
    running.stop()


def outrider_generate(capsys: pytest.CaptureFixture[str], prompt: str, *flags: str) -> Any:
    """`outrider generate --json` in this process (its engine is in-process too), in the
    runtime's dtype."""
    from router.cli import main

    capsys.readouterr()
    exact = ["--dtype", "float32", "--quantization", "none"]
    assert main(["generate", prompt, "--json", *exact, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_openai_client_matches_outrider_generate(router, capsys) -> None:  # type: ignore[no-untyped-def]
    greedy = ["--temperature", "0", "--max-tokens", "20", "--spec-method", "ngram"]
    expected = outrider_generate(capsys, PROMPT, *greedy)["text"]
    expected_chat = outrider_generate(capsys, QUESTION, "--chat", *greedy)["text"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.speculative["verify_steps"] > 0  # statistics ride along in usage
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == expected
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    assert reply.choices[0].message.content == expected_chat
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat


def test_grpc_streams_the_same_tokens(router) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    _, whole, _, _ = post(
        router.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    )
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=16, temperature=0.0)
        responses = list(stub.Generate(request))
    assert "".join(r.text for r in responses) == whole["choices"][0]["text"]
    assert responses[-1].usage.completion_tokens == 16


def test_logprobs_cross_the_runtime(router, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Each token's log-probability comes through Ray and HTTP as the model's (a plain
    prefill over prompt and answer here); the prefill worker's part is in
    tests/cluster/test_runtime.py."""
    from tests.model.helpers import all_logits

    prompt = (
        "Log-probabilities over the runtime. " + "A prompt long enough to prefill remotely. " * 3
    )
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    code, out, _, _ = post(router.url + "/v1/completions", body)
    assert code == 200, out
    logprobs = out["choices"][0]["logprobs"]
    tok = checkpoint.tokenizer
    prompt_ids = tok.encode(prompt)
    answer = [tok.encode(t, add_special_tokens=False) for t in logprobs["tokens"]]
    assert all(len(ids) == 1 for ids in answer)  # each token's text encodes back to it
    ids = prompt_ids + [ids[0] for ids in answer]
    expected = all_logits(model_fp32, ids).float().log_softmax(-1)[len(prompt_ids) - 1 : -1]
    chosen = [float(row[t]) for row, t in zip(expected, ids[len(prompt_ids) :], strict=True)]
    assert logprobs["token_logprobs"] == pytest.approx(chosen, abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    # Scoring the prompt: computed on the verifier, however long (never the prefill worker).
    scored = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    code, out, _, _ = post(router.url + "/v1/completions", scored)
    assert code == 200, out
    prompt_rows = all_logits(model_fp32, prompt_ids).float().log_softmax(-1)
    expected_prompt = [float(prompt_rows[i, t]) for i, t in enumerate(prompt_ids[1:])]
    assert out["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        expected_prompt, abs=1e-4
    )


def test_several_choices_over_the_runtime(router, runtime) -> None:  # type: ignore[no-untyped-def]
    """Choices of one request run in one verifier group, streamed by index."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    _, one, _, _ = post(router.url + "/v1/completions", body)
    _, three, _, _ = post(router.url + "/v1/completions", {**body, "n": 3})
    assert [c["text"] for c in three["choices"]] == [one["choices"][0]["text"]] * 3
    groups = {group_of(router, f"{three['id']}-{i}") for i in range(3)}
    assert len(groups) == 1
    _, _, raw, _ = post(router.url + "/v1/completions", {**body, "n": 2, "stream": True})
    texts = ["", ""]
    for event in sse_events(raw)[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [one["choices"][0]["text"]] * 2
    deadline = time.monotonic() + 30
    while not _idle(runtime) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _idle(runtime)


def test_the_verifier_refusing_a_request_is_a_400_and_the_groups_keep_serving(router) -> None:  # type: ignore[no-untyped-def]
    """The engine's own refusal (no draft model in this deployment) crosses Ray as the actor's
    exception and reaches the client as an OpenAI 400."""
    body = {"prompt": PROMPT, "max_tokens": 4, "speculative": {"method": "draft_model"}}
    code, out, _, _ = post(router.url + "/v1/completions", body)
    assert code == 400 and "not available" in out["error"]["message"], out
    assert "Traceback" not in out["error"]["message"]
    for _ in range(2):  # both groups, whichever the router picks
        assert post(router.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200


def test_a_shared_prefix_goes_back_to_the_group_that_cached_it(router) -> None:  # type: ignore[no-untyped-def]
    url = router.url + "/v1/chat/completions"
    before = routed_counts(router)
    groups = []
    for question in ("Name a river.", "Name a mountain.", "Name a city.", "Name a sea."):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        code, out, _, _ = post(url, {"messages": messages, "max_tokens": 4, "temperature": 0})
        assert code == 200
        groups.append(group_of(router, out["id"]))
        time.sleep(0.1)  # the prefix index is written just after the first token
    assert len(set(groups)) == 1, groups
    after = routed_counts(router)
    assert after.get((groups[0], "prefix"), 0) - before.get((groups[0], "prefix"), 0) >= 3
    # Both groups are reported to Prometheus.
    _, metrics = get(router.url + "/metrics")
    assert 'outrider_verifier_queue_depth{group="verifier-g1-r0"}' in metrics


def _idle(runtime) -> bool:  # type: ignore[no-untyped-def]
    loads = ray.get([v.load.remote() for v in runtime.pools.verifiers])
    return all(x.queue_depth == 0 and x.kv_usage == 0 for x in loads)


def test_a_client_that_leaves_mid_stream_frees_its_kv_blocks(router, runtime) -> None:  # type: ignore[no-untyped-def]
    assert _idle(runtime)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with raw_completion_stream(router.port, body) as sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
        assert not _idle(runtime)  # it holds blocks in a verifier now
    deadline = time.monotonic() + 60
    while not _idle(runtime) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _idle(runtime)
    assert get(router.url + "/ready") == (200, {"status": "ready", "redis": True})


KEY = "sk-runtime-shared"


@pytest.fixture(scope="module")
def keyed_replicas(runtime, checkpoint, redis_server) -> Iterator[list[RunningRouter]]:  # type: ignore[no-untyped-def]
    """Two more router replicas over the same pools, sharing one Redis database with one key
    limited to 3 requests (then 0.5 per second)."""
    from router.keys import KeyLine

    keys = [KeyLine(KEY, "shared", 0.5, 3)]
    replicas = [
        runtime_router(runtime, checkpoint, redis_server, db=8, keys=keys) for _ in range(2)
    ]
    yield replicas
    for r in replicas:
        r.stop()


def test_two_replicas_over_the_runtime_share_one_rate_limit(keyed_replicas) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert post(keyed_replicas[0].url + "/v1/completions", body)[0] == 401
    codes = [post(r.url + "/v1/completions", body, KEY)[0] for r in keyed_replicas * 2]
    assert codes == [200, 200, 200, 429]


@pytest.mark.parametrize(("body", "status", "message", "param"), BAD)
def test_bad_requests_over_the_runtime(router, body, status, message, param) -> None:  # type: ignore[no-untyped-def]
    code, out, _, _ = post(router.url + "/v1/completions", body)
    assert code == status, out
    assert message in out["error"]["message"]
    if param is not None:
        assert out["error"]["param"] == param
    assert post(router.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0] == 200


def test_another_replica_resumes_a_request_whose_client_left(router, router_b) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    _, whole, _, _ = post(router.url + "/v1/completions", body)
    request_id = leave_mid_stream(router, body)
    record = record_when_finished(router_b, request_id)
    assert record["finish_reason"] == "abort" and 0 < len(record["token_ids"]) < 40
    code, out, _, _ = post(f"{router_b.url}/v1/requests/{request_id}/resume", b"")
    assert code == 200, out
    assert out["resumed"] == {"from": request_id, "committed_tokens": len(record["token_ids"])}
    assert out["choices"][0]["text"] == whole["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 40 - len(record["token_ids"])
    _, _, raw, _ = post(f"{router_b.url}/v1/requests/{request_id}/resume", {"stream": True})
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    # A finished request has nothing to resume; an unknown one is not there.
    code, err, _, _ = post(f"{router_b.url}/v1/requests/{out['id']}/resume", b"")
    assert code == 400 and "nothing to resume" in err["error"]["message"]
    assert post(f"{router_b.url}/v1/requests/nope/resume", b"")[0] == 404


def test_structured_output_over_the_runtime_and_its_resume(router, router_b) -> None:  # type: ignore[no-untyped-def]
    """A grammar crosses Ray to the verifier, which masks the first token it samples from the
    prefill worker's logits (a long prompt) and every verify row after; a resumed request's
    grammar reads the answer so far before going on, so the text is the uninterrupted one's."""
    long_prompt = "Write the colour of each fruit. " * 4 + "Banana:"
    body = {
        "prompt": long_prompt,
        "max_tokens": 40,
        "temperature": 0,
        "guided_regex": " (yellow|green|red)(, [a-z]+){12}\\.",
    }
    code, whole, _, _ = post(router.url + "/v1/completions", body)
    assert code == 200, whole
    text = whole["choices"][0]["text"]
    assert re.fullmatch(body["guided_regex"], text), text
    assert whole["choices"][0]["finish_reason"] == "stop"
    request_id = leave_mid_stream(router, body)
    record = record_when_finished(router_b, request_id)
    assert record["finish_reason"] == "abort"
    assert 0 < len(record["token_ids"]) < whole["usage"]["completion_tokens"]
    code, out, _, _ = post(f"{router_b.url}/v1/requests/{request_id}/resume", b"")
    assert code == 200, out
    assert out["choices"][0]["text"] == text


def test_a_forced_tool_call_resumed_on_another_replica(router, router_b) -> None:  # type: ignore[no-untyped-def]
    """A chat request's tool calling is part of what it takes to resume it: the resumed
    answer's call is the uninterrupted one's, read from the whole text."""
    weather = {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}}}
    body = {
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
        "tools": [{"type": "function", "function": weather}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "temperature": 0,
    }
    url = "/v1/chat/completions"
    code, whole, _, _ = post(router.url + url, body)
    assert code == 200, whole
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    request_id = leave_mid_stream(router, body, url)
    record = record_when_finished(router_b, request_id)
    assert record["finish_reason"] == "abort"
    assert 0 < len(record["token_ids"]) < whole["usage"]["completion_tokens"]
    code, out, _, _ = post(f"{router_b.url}/v1/requests/{request_id}/resume", b"")
    assert code == 200, out
    message = out["choices"][0]["message"]
    assert message["content"] is None and out["choices"][0]["finish_reason"] == "stop"
    ((resumed),) = message["tool_calls"]
    assert resumed["function"] == call["function"]


def test_a_load_test_over_the_runtime(router, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`python -m load_tests run` against this router: two users over both verifier groups;
    every request succeeds and the client's token counts equal the router's."""
    from load_tests import report
    from load_tests.__main__ import main

    argv = ["run", "--url", router.url, "--workload", small_workload(tmp_path)]
    argv += ["--concurrency", "2", "--requests", "4", "--max-tokens", "8", "--warmup", "0"]
    assert main([*argv, "--metrics-interval", "0.2", "--out", str(tmp_path)]) == 0
    result = report.load(tmp_path)
    (summary,) = result.summaries()
    view = result.servers["2 users"]
    assert summary.ok == summary.sent == 4
    assert view is not None and view.requests == {"ok": 4}
    assert view.counters["generated"] == summary.output_tokens > 0
    assert len(view.max_queue) == 2  # both verifier groups reported their queues
    assert sum(view.routed.values()) == 4  # every request was routed, for a reason it names


# Long enough that the stream is still going when its verifier is killed a few tokens in.
MOVING = {"prompt": PROMPT, "max_tokens": 96, "extra_body": {"ignore_eos": True}}


def _kill_group_of(router: RunningRouter, runtime: Any, request_id: str) -> tuple[Any, int]:
    """Kill the verifier serving `request_id` (Ray restarts it); the actor and its old pid."""
    _, record = get(f"{router.url}/v1/requests/{request_id}")
    actor = runtime.pools.verifiers[runtime.pools.verifier_names.index(record["group"])]
    pid = ray.get(actor.info.remote())["pid"]
    ray.kill(actor, no_restart=False)
    return actor, pid


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}])
def test_a_stream_whose_verifier_dies_goes_on_on_another_group(  # type: ignore[no-untyped-def]
    router, runtime, sampling
) -> None:
    """The official client streams a greedy, then a seeded sampled completion; its verifier is
    killed a few tokens in. The router moves it to the other group with what it committed: the
    client sees no error and the text, usage and finish reason of an uninterrupted run."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model=MODEL, **MOVING, **sampling)
    before = migration_count(router)
    raw = client.completions.with_raw_response.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **MOVING, **sampling
    )
    pieces, killed, usage, finish = [], None, None, None
    for chunk in raw.parse():
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
        if killed is None and len(pieces) >= 4:
            killed = _kill_group_of(router, runtime, raw.headers["x-request-id"])
    assert killed is not None
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == whole.usage.completion_tokens == 96
    assert migration_count(router) == before + 1
    # The request's span on its new group says it continued from the committed tokens.
    from cluster import telemetry

    def continued() -> list[int]:  # the span ends with its stream, just after the last event
        return [
            s["attributes"]["outrider.continued_tokens"]
            for s in telemetry.finished_spans()
            if s["attributes"].get("outrider.request_id") == raw.headers["x-request-id"]
            and "outrider.continued_tokens" in s["attributes"]
        ]

    deadline = time.monotonic() + 10
    while not continued() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(continued()) == 1 and 0 < continued()[0] < 96
    wait_restarted(*killed)  # back in its pool for what follows


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}])
def test_a_grpc_stream_whose_verifier_dies_goes_on(router, runtime, sampling) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(
        prompt=PROMPT, max_tokens=96, ignore_eos=True, **sampling
    )
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        whole = list(stub.Generate(request))
        responses, killed = [], None
        for response in stub.Generate(request):
            responses.append(response)
            if killed is None and len(responses) >= 4:
                killed = _kill_group_of(router, runtime, response.request_id)
    assert killed is not None
    assert [t for r in responses for t in r.token_ids] == [t for r in whole for t in r.token_ids]
    assert "".join(r.text for r in responses) == "".join(r.text for r in whole)
    assert responses[-1].usage.completion_tokens == 96
    wait_restarted(*killed)
