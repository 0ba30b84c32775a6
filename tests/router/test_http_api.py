"""The HTTP API on loopback (uvicorn, real Redis) over one in-process engine, through the official
`openai` client: completions and chat against plain decoding, streaming and usage, predicted
outputs, stop strings, log-probabilities, prompt scoring, options together. Request options,
choices and errors, and operations are in the test_http_*.py files beside it; the same router
over the Ray runtime is in test_router_runtime.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.router.helpers import (
    MODEL,
    PROMPT,
    plain_greedy,
    post,
    sse_events,
)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_openai_client_completions_and_chat_match_plain_decoding(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    expected = tok.decode(plain_greedy(model_fp32, checkpoint, tok.encode(PROMPT), 12))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = tok.encode(tok.apply_chat_template(messages))
    expected_chat = tok.decode(plain_greedy(model_fp32, checkpoint, chat_ids, 10))
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert reply.choices[0].message.content == expected_chat
    assert reply.usage.prompt_tokens == len(chat_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(stream)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == expected_chat
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 10
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_an_answer_begun_in_the_last_message_is_continued(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """vLLM's continue_final_message through the openai client (its extra_body): the answer is
    what plain decoding writes after the begun message, and only that."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour I pick is"},
    ]
    prompt = tok.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    expected = tok.decode(plain_greedy(model_fp32, checkpoint, tok.encode(prompt), 8))
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(tok.encode(prompt))
    code, out, _, _ = post(
        server + "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True},
    )
    assert (code, out["error"]["param"]) == (400, "continue_final_message")


def test_stream_and_whole_agree_with_usage_and_statistics(server: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    status, out, _, headers = post(server + "/v1/completions", body)
    assert status == 200 and headers["x-request-id"] == out["id"]
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        5,
        10,
        15,
    )
    assert usage["speculative"]["verify_steps"] == 9
    _, _, raw, _ = post(server + "/v1/completions", {**body, "stream": True})
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == out["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])  # only with include_usage


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens sent
    so far, and the last one's is the usage chunk's."""
    messages = [{"role": "user", "content": "Count to five."}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "stream": True}
    _, _, raw, _ = post(server + "/v1/chat/completions", {**body, "stream_options": options})
    *chunks, final, done = sse_events(raw)
    assert done == "[DONE]" and final["choices"] == []
    assert all(chunk["usage"] is not None for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts[0] == 0 and counts == sorted(counts)  # the role chunk, then as tokens come
    assert chunks[-1]["usage"] == final["usage"] and final["usage"]["completion_tokens"] == 10
    prompt_tokens = final["usage"]["prompt_tokens"]
    assert all(chunk["usage"]["prompt_tokens"] == prompt_tokens for chunk in chunks)
    # Without include_usage the option does nothing (as vLLM's).
    only = {"continuous_usage_stats": True}
    _, _, raw, _ = post(server + "/v1/chat/completions", {**body, "stream_options": only})
    assert all("usage" not in event for event in sse_events(raw)[:-1])


def test_truncate_prompt_tokens_keeps_the_prompts_end(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """vLLM's truncate_prompt_tokens: the answer is plain decoding's over the prompt's last N
    tokens, which usage counts (and an echo shows)."""
    tok = checkpoint.tokenizer
    ids = tok.encode("One, two, three, four, five, six, seven, eight,")
    kept = ids[-6:]
    expected = tok.decode(plain_greedy(model_fp32, checkpoint, kept, 6))
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": 6}
    code, out, _, _ = post(server + "/v1/completions", {**body, "echo": True})
    assert code == 200, out
    assert out["choices"][0]["text"] == tok.decode(kept) + expected
    assert out["usage"]["prompt_tokens"] == 6
    long_enough = {**body, "truncate_prompt_tokens": len(ids) + 5}  # nothing to cut
    _, out, _, _ = post(server + "/v1/completions", long_enough)
    assert out["usage"]["prompt_tokens"] == len(ids)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    _, out, _, _ = post(server + "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 3})
    assert out["usage"]["prompt_tokens"] == 3
    code, out, _, _ = post(server + "/v1/completions", {**body, "truncate_prompt_tokens": 0})
    assert (code, out["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_a_predicted_output_speeds_the_answer_up_and_changes_nothing(server: str) -> None:
    """OpenAI's Predicted Outputs through the openai client: the answer is the one without a
    prediction; n-gram drafts copy the prediction (most of a step's drafts accepted), and usage
    counts the prediction's tokens the answer held and those it did not."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    ask: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}
    ngram = {"speculative": {"method": "ngram", "num_speculative_tokens": 4}}
    plain = client.chat.completions.create(**ask, extra_body=ngram)
    answer = plain.choices[0].message.content
    predicted = client.chat.completions.create(
        **ask, prediction={"type": "content", "content": answer}, extra_body=ngram
    )
    assert predicted.choices[0].message.content == answer
    usage = predicted.usage
    assert usage.speculative["mean_acceptance_length"] > max(
        3.0, plain.usage.speculative["mean_acceptance_length"]
    )
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= usage.completion_tokens - 1
    assert details.rejected_prediction_tokens <= 1
    wrong = "Mountains stand in snow, quiet pines hold the cold air, a hawk circles once."
    chunks = list(
        client.chat.completions.create(
            **ask,
            prediction={"type": "content", "content": wrong},
            extra_body=ngram,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    details = chunks[-1].usage.completion_tokens_details
    assert details.rejected_prediction_tokens > details.accepted_prediction_tokens
    assert plain.usage.completion_tokens_details is None  # only with a prediction


def test_speculative_extension_field_and_statistics(server: str) -> None:
    body = {"prompt": "A B C D A B C D A B C", "max_tokens": 12, "temperature": 0}
    _, plain, _, _ = post(server + "/v1/completions", body)
    _, spec, _, _ = post(server + "/v1/completions", {**body, "speculative": {"method": "ngram"}})
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    stats = spec["usage"]["speculative"]
    assert stats["drafted"] > 0 and stats["verify_steps"] + stats["accepted"] == 11
    assert plain["usage"]["speculative"]["drafted"] == 0
    _, off, _, _ = post(server + "/v1/completions", {**body, "speculative": {"enabled": False}})
    assert off["usage"]["speculative"]["drafted"] == 0


def test_stop_string_across_tokens_and_multibyte_text_in_the_stream(server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    _, whole, _, _ = post(server + "/v1/completions", body)
    text = whole["choices"][0]["text"]  # " Paris.\n\nThe answer is: ..."
    stop = text[2:5]  # starts inside the first token, ends in a later one
    _, _, raw, _ = post(server + "/v1/completions", {**body, "stop": [stop], "stream": True})
    events = sse_events(raw)[:-1]
    assert "".join(e["choices"][0]["text"] for e in events) == text[:2]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # Characters of several bytes arrive whole in every event, never split across two.
    emoji = {"prompt": "Emoji: 🎉🎉🎉 and café, naïve, 東京. Again: 🎉", "max_tokens": 24}
    _, _, raw, _ = post(server + "/v1/completions", {**emoji, "temperature": 0, "stream": True})
    pieces = [e["choices"][0]["text"] for e in sse_events(raw)[:-1]]
    assert all("\ufffd" not in p for p in pieces)
    _, whole_emoji, _, _ = post(server + "/v1/completions", {**emoji, "temperature": 0})
    assert "".join(pieces) == whole_emoji["choices"][0]["text"]


def test_logprobs_are_the_models_and_streams_carry_them(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """Completions (legacy shape) and chat (`content` entries with bytes), whole and streamed,
    with n-gram speculation: each token's log-probability is the log-softmax of the target's
    logits at its position, computed here in one plain prefill over prompt and answer."""
    from tests.model.helpers import all_logits

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    spec = {"speculative": {"method": "ngram", "num_speculative_tokens": 4}}
    prompt = "one two three, one two three, one two three,"
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, extra_body=spec
    )
    logprobs = whole.choices[0].logprobs
    assert whole.usage.speculative["accepted"] > 0
    assert len(logprobs.tokens) == whole.usage.completion_tokens == 10
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    prompt_ids = tok.encode(prompt)
    answer = plain_greedy(model_fp32, checkpoint, prompt_ids, 10)
    assert logprobs.tokens == [tok.decode([t]) for t in answer]
    with torch.no_grad():
        expected = torch.log_softmax(all_logits(model_fp32, prompt_ids + answer).float(), -1)
    rows = expected[len(prompt_ids) - 1 : -1]
    for row, token, value, top in zip(
        rows, answer, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value == pytest.approx(float(row[token]), abs=1e-4)
        assert len(top) <= 4 and max(top, key=top.get) == tok.decode([token])
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-4
        )
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body=spec,
        )
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == logprobs.text_offset
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(
        logprobs.token_logprobs, abs=1e-4
    )

    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == reply.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.top_logprobs) for e in entries] == [(e.token, []) for e in content]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    # vLLM's return_tokens_as_token_ids: the same entries, each token named `token_id:<id>`.
    by_id = {**spec, "return_tokens_as_token_ids": True}
    named = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, extra_body=by_id
    ).choices[0]
    assert named.text == whole.choices[0].text
    assert named.logprobs.tokens == [f"token_id:{t}" for t in answer]
    assert named.logprobs.text_offset == logprobs.text_offset  # offsets into the text
    for top_by_id, top in zip(named.logprobs.top_logprobs, logprobs.top_logprobs, strict=True):
        as_text = {tok.decode([int(k.removeprefix("token_id:"))]): v for k, v in top_by_id.items()}
        assert as_text == pytest.approx(top, abs=1e-4)
    reply_by_id = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for entry, by_text in zip(reply_by_id.choices[0].logprobs.content, content, strict=True):
        token_id = int(entry.token.removeprefix("token_id:"))
        assert tok.decode([token_id]) == by_text.token and entry.bytes == by_text.bytes


def test_scoring_a_prompt_with_echo_and_prompt_logprobs(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """What evaluation harnesses send: `max_tokens` 0 with `echo` and `logprobs` scores the
    prompt (null for its first token, then the model's log-softmax at each position); with
    tokens to generate, the echoed prompt's entries come before the answer's; vLLM's
    `prompt_logprobs` gives the same numbers with ranks, on completions and chat."""
    from tests.model.helpers import all_logits

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(prompt)
    with torch.no_grad():
        expected = torch.log_softmax(all_logits(model_fp32, ids).float(), -1)
    chosen = [float(expected[i, t]) for i, t in enumerate(ids[1:])]
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)

    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    _, plain, _, _ = post(server + "/v1/completions", body)
    _, echoed, _, _ = post(server + "/v1/completions", {**body, "echo": True})
    answer = plain["choices"][0]
    assert echoed["choices"][0]["text"] == prompt + answer["text"]
    both = echoed["choices"][0]["logprobs"]
    assert both["tokens"] == lp.tokens + answer["logprobs"]["tokens"]
    assert both["token_logprobs"][len(ids) :] == pytest.approx(
        answer["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert echoed["usage"]["completion_tokens"] == 4

    _, vllm_style, _, _ = post(
        server + "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    )
    entries = vllm_style["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, token, value, row in zip(entries[1:], ids[1:], chosen, expected[:-1], strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert entry[str(token)]["decoded_token"] == tok.decode([token])
        top = row.topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entry) and entry[str(top[0])]["rank"] == 1
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    _, reply, _, _ = post(server + "/v1/chat/completions", chat)
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    assert len(reply["prompt_logprobs"]) == len(chat_ids)
    assert all(len(e) == 1 for e in reply["prompt_logprobs"][1:])
    _, _, raw, _ = post(server + "/v1/chat/completions", {**chat, "stream": True})
    assert sse_events(raw)[0]["prompt_logprobs"] == reply["prompt_logprobs"]


COMBINED = [
    {"n": 2, "logprobs": 2, "speculative": {"method": "ngram"}},
    {"n": 2, "presence_penalty": 0.5, "stop": [","], "min_tokens": 3},
    {"logprobs": 0, "logit_bias": {"11": 5}, "frequency_penalty": 0.4},
    {"n": 3, "stop_token_ids": [30], "speculative": {"enabled": False}},
    {"n": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 1},
    {"echo": True, "max_tokens": 0, "logprobs": 0},
]


@pytest.mark.parametrize("options", COMBINED)
def test_options_together_stream_what_the_whole_answer_holds(
    server: str, options: dict[str, Any]
) -> None:
    """Greedy requests with several options at once: every choice of the stream adds up to the
    same choice of the whole answer (text, log-probabilities, finish reason), and usage agrees."""
    body = {"prompt": "1, 2, 3, 1, 2, 3, 1, 2,", "max_tokens": 10, "temperature": 0, **options}
    code, whole, _, _ = post(server + "/v1/completions", body)
    assert code == 200, whole
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    _, _, raw, _ = post(server + "/v1/completions", stream)
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    # The same usage, but for the cache: the second request finds the first one's prompt in it.
    streamed_usage = events[-2]["usage"]
    cached = streamed_usage.pop("prompt_tokens_details")["cached_tokens"]
    assert whole["usage"].pop("prompt_tokens_details")["cached_tokens"] <= cached
    assert streamed_usage == whole["usage"]
    n = options.get("n", 1)
    texts, tokens, finish = [""] * n, [[] for _ in range(n)], [None] * n
    for event in events[:-2]:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += choice["text"]
            finish[i] = choice["finish_reason"] or finish[i]
            if choice["logprobs"]:
                tokens[i] += choice["logprobs"]["tokens"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert finish == [c["finish_reason"] for c in whole["choices"]]
    if "logprobs" in options:
        assert tokens == [c["logprobs"]["tokens"] for c in whole["choices"]]
        counted = sum(len(c["logprobs"]["tokens"]) for c in whole["choices"])
        echoed = n * whole["usage"]["prompt_tokens"] if options.get("echo") else 0
        assert counted == whole["usage"]["completion_tokens"] + echoed
    if "prompt_logprobs" in options:
        opening = [e["choices"][0] for e in events[:n]]
        assert [c["prompt_logprobs"] for c in opening] == [
            c["prompt_logprobs"] for c in whole["choices"]
        ]
