"""Several choices, batches of prompts, bad requests answered in OpenAI's error format with the
server serving on, clients that leave, and concurrent requests, through the HTTP API (as
test_http_api.py serves it)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.router.helpers import (
    MODEL,
    PROMPT,
    get,
    plain_greedy,
    post,
    raw_completion_stream,
    sse_events,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_several_choices_whole_and_streamed(
    open_router, local_engine, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """`n` choices: greedy ones are plain decoding's text each; seeded sampled choice i is what
    one request with seed + i gives; a stream interleaves the choices by `index`; usage sums
    the choices' tokens; each choice is registered, on one group, and all blocks come back."""
    client = openai.OpenAI(base_url=open_router.url + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    expected = tok.decode(plain_greedy(model_fp32, checkpoint, tok.encode(PROMPT), 8))
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [expected] * 3
    assert greedy.usage.prompt_tokens == 5 and greedy.usage.completion_tokens == 24
    for i in range(3):
        code, record = get(f"{open_router.url}/v1/requests/{greedy.id}-{i}")
        assert code == 200 and record["group"] == "local"

    sampled = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7}
    _, together, _, _ = post(open_router.url + "/v1/completions", {**sampled, "n": 3})
    texts = [c["text"] for c in together["choices"]]
    alone = [
        post(open_router.url + "/v1/completions", {**sampled, "seed": 7 + i})[1]["choices"][0]
        for i in range(3)
    ]
    assert texts == [c["text"] for c in alone]
    assert len(set(texts)) > 1

    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=1.0,
            seed=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = ["", ""]
    finish = [None, None]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert streamed == [c.message.content for c in reply.choices]
    assert finish == [c.finish_reason for c in reply.choices]
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    engine = local_engine.engine
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


def test_a_batch_of_prompts(open_router, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A list of prompts (text, or token ids, as evaluation harnesses batch them): choice k
    answers prompt k // n, each as a request of its own would; usage counts every prompt;
    scoring a batch echoes each prompt with its own log-probabilities."""
    url = open_router.url + "/v1/completions"
    prompts = [PROMPT, "Once upon a time", "def fib(n):"]
    body = {"prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2}
    code, out, _, _ = post(url, body)
    assert code == 200, out
    alone = [post(url, {**body, "prompt": p, "n": 1})[1] for p in prompts]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [
        a["choices"][0]["text"] for a in alone for _ in range(2)
    ]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert out["usage"]["completion_tokens"] == 2 * sum(
        a["usage"]["completion_tokens"] for a in alone
    )
    assert get(f"{open_router.url}/v1/requests/{out['id']}-5")[0] == 200
    _, _, raw, _ = post(url, {**body, "n": 1, "stream": True})
    streamed = ["", "", ""]
    for event in sse_events(raw)[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [a["choices"][0]["text"] for a in alone]

    tok = checkpoint.tokenizer
    ids = [tok.encode(p) for p in prompts]
    scoring = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    _, scored, _, _ = post(url, scoring)
    assert [c["text"] for c in scored["choices"]] == [tok.decode(i) for i in ids]
    for choice, single in zip(scored["choices"], ids, strict=True):
        alone_scored = post(url, {**scoring, "prompt": single})[1]["choices"][0]
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            alone_scored["logprobs"]["token_logprobs"][1:], abs=1e-4
        )
    assert scored["usage"] == {**scored["usage"], "completion_tokens": 0}


def test_choices_after_the_first_start_from_its_cached_prompt(open_router, local_engine) -> None:  # type: ignore[no-untyped-def]
    """The first choice computes the prompt; the others begin once its blocks are in the
    prefix cache and compute only what the cache lacks (the last, partial block)."""
    engine = local_engine.engine
    computed: list[tuple[str, int]] = []

    def listen(report) -> None:  # type: ignore[no-untyped-def]
        computed.extend((r.request_id, r.prefill_tokens) for r in report.rounds)

    prompt = "Three choices share this prompt. " * 6
    num_prompt = len(engine.tokenizer.encode(prompt))
    engine.step_listeners.append(listen)
    try:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "n": 3}
        _, out, _, _ = post(open_router.url + "/v1/completions", body)
    finally:
        engine.step_listeners.remove(listen)
    prefill = {i: sum(n for rid, n in computed if rid == f"{out['id']}-{i}") for i in range(3)}
    assert prefill[0] == num_prompt
    cached = (num_prompt - 1) // 16 * 16
    assert cached > 0 and prefill[1] == prefill[2] == num_prompt - cached


def test_a_client_that_leaves_frees_every_choice(open_router, local_engine) -> None:  # type: ignore[no-untyped-def]
    engine = local_engine.engine
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 3}
    with raw_completion_stream(open_router.port, body) as sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


BAD = [
    (b"{not json", 400, "not valid JSON", None),
    (b'{"prompt": "caf\xe9"}', 400, "not valid UTF-8", None),
    (b"[1, 2]", 400, "JSON object", None),
    ({"prompt": PROMPT, "max_tokens": -1}, 400, "greater than or equal to 0", "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "5"}, 400, "valid integer", "max_tokens"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "valid number", "temperature"),
    ({"prompt": PROMPT, "max_tokens": 1.5}, 400, "valid integer", "max_tokens"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "greater than 0", "top_p"),
    ({"prompt": PROMPT, "n": 17}, 400, "less than or equal to 16", "n"),
    ({"prompt": ""}, 400, "must not be empty", "prompt"),
    ({"prompt": [1, 2, 10**9]}, 400, "token ids", "prompt"),
    ({"max_tokens": 3}, 400, "Field required", "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist", "model"),
    ({"prompt": "word " * 600}, 400, "maximum context length is", "prompt"),
    ({"prompt": PROMPT, "stop": 3}, 400, "stop", "stop"),
    ({"prompt": PROMPT, "logprobs": 21}, 400, "less than or equal to 20", "logprobs"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "needs echo", "max_tokens"),
    (
        {"prompt": PROMPT, "response_format": {"type": "xml"}},
        400,
        "is not supported",
        "response_format",
    ),
    (
        {"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "needs json_schema.schema",
        "response_format",
    ),
    ({"prompt": PROMPT, "guided_regex": "(ab"}, 400, "invalid regex", "guided_regex"),
    ({"prompt": PROMPT, "guided_choice": []}, 400, "non-empty list", "guided_choice"),
    ({"prompt": PROMPT, "guided_json": "{oops"}, 400, "not valid JSON", "guided_json"),
    (
        {"prompt": PROMPT, "guided_json": {"type": "objectx"}},
        400,
        "Invalid type",
        "guided_json",
    ),
    (
        {"prompt": PROMPT, "guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
        400,
        "one structured output at most",
        None,
    ),
    (
        {"prompt": PROMPT, "structured_outputs": {"grammar": "start: nothing"}},
        400,
        "unknown name",
        "structured_outputs",
    ),
    (
        {"prompt": PROMPT, "structured_outputs": {"regex": "a", "whitespace": "x"}},
        400,
        "Extra inputs",
        "structured_outputs.whitespace",
    ),
    ({"prompt": PROMPT, "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": [PROMPT] * 65}, 400, "at most 64 prompts", "prompt"),
    ({"prompt": [PROMPT, 5]}, 400, "", None),
    ({"prompt": [PROMPT, ""]}, 400, "must not be empty", "prompt"),
    ({"prompt": PROMPT, "suffix": "end"}, 400, "suffix", "suffix"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, 400, "less than or equal to 20", "prompt_logprobs"),
    ({"prompt": PROMPT, "stop_token_ids": [10**9]}, 400, "stop token ids", "stop_token_ids"),
    ({"prompt": PROMPT, "logit_bias": {"the": 1}}, 400, "keys must be token ids", "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, 400, "[-100, 100]", None),
    ({"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", None),
    (
        {"prompt": PROMPT, "presence_penalty": 2.5},
        400,
        "less than or equal to 2",
        "presence_penalty",
    ),
    ({"prompt": PROMPT, "repetition_penalty": 0}, 400, "greater than 0", "repetition_penalty"),
    ({"prompt": PROMPT, "speculative": {"method": "magic"}}, 400, "speculative method", None),
    ({"prompt": PROMPT, "speculative": {"method": "draft_model"}}, 400, "not available", None),
    ({"prompt": PROMPT, "speculative": {"k": 3}}, 400, "Extra inputs", "speculative.k"),
    (b"x" * (5 << 20), 413, "request body over", None),
]


@pytest.mark.parametrize(("body", "status", "message", "param"), BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: str, body: Any, status: int, message: str, param: str | None
) -> None:
    code, out, _, _ = post(server + "/v1/completions", body)
    assert code == status, out
    assert message in out["error"]["message"]
    assert out["error"]["type"] and out["error"]["code"] == status
    if param is not None:
        assert out["error"]["param"] == param
    ok, _, _, _ = post(server + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert ok == 200


def test_bad_chat_requests(server: str) -> None:
    url = server + "/v1/chat/completions"
    for body, param in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]},
            "tools.0.type",
        ),
        ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ):
        code, out, _, _ = post(url, body)
        assert (code, out["error"]["param"]) == (400, param)
    json_schema = {"type": "json_schema", "json_schema": {"schema": "not an object"}}
    code, out, _, _ = post(
        url, {"messages": [{"role": "user", "content": "hi"}], "response_format": json_schema}
    )
    assert (code, out["error"]["param"]) == (400, "response_format")
    asking_for_nothing = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "best_of": 1,
    }
    assert post(url, asking_for_nothing)[0] == 200


def test_unknown_routes_and_methods_are_openai_errors(server: str) -> None:
    code, out = get(server + "/v1/nothing")
    assert code == 404 and out["error"]["type"] == "not_found_error"
    code, out = get(server + "/v1/completions")  # GET on a POST route
    assert code == 405 and "error" in out


def test_a_client_that_leaves_mid_stream_frees_its_blocks(open_router, local_engine) -> None:  # type: ignore[no-untyped-def]
    engine = local_engine.engine
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with raw_completion_stream(open_router.port, body) as sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)  # a few tokens out
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()  # aborted long before 200 tokens
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    status, out, _, _ = post(open_router.url + "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 3


def test_concurrent_requests_each_get_their_own_answer(server: str) -> None:
    prompts = [PROMPT, "Once upon a time", "def fib(n):", "The best way to learn is"]
    alone = [
        post(server + "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})[1]
        for p in prompts
    ]
    results: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}
        results[i] = post(server + "/v1/completions", body)[1]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["choices"][0]["text"] for r in results] == [a["choices"][0]["text"] for a in alone]
