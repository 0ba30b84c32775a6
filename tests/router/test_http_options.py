"""Request options reach the engine through the HTTP API (as test_http_api.py serves it):
penalties, stop tokens, logit bias and min tokens, allowed tokens and bad words, structured
output, tool calls, cached-token usage, special tokens, tokenize and detokenize."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from router.tools import ToolCalling, block_text, call_grammar, read_answer, render_prompt
from tests.model.helpers import NAME_AND_AGE, PERSON_QUESTION, TIME, WEATHER
from tests.router.helpers import (
    MODEL,
    PROMPT,
    plain_greedy,
    post,
)
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.engine.structured import compile_grammar

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_penalties_reach_the_engine(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's presence and frequency penalties and vLLM's repetition penalty change the
    greedy text exactly as plain decoding with them does."""
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    penalties = {"presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, out, _, _ = post(server + "/v1/completions", {**body, **penalties})
    _, unpenalized, _, _ = post(server + "/v1/completions", body)
    engine = SequentialEngine(model_fp32, max_model_len=256)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **penalties)
    tok = checkpoint.tokenizer
    expected = tok.decode(engine.generate(tok.encode(prompt), params).token_ids)
    assert out["choices"][0]["text"] == expected != unpenalized["choices"][0]["text"]


def test_stop_token_ids_end_the_text_without_it(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    tokens = plain_greedy(model_fp32, checkpoint, tok.encode(PROMPT), 8)
    at = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [tokens[at]]}
    _, out, _, _ = post(server + "/v1/completions", body)
    assert out["choices"][0]["text"] == tok.decode(tokens[:at])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == at + 1


def test_logit_bias_and_min_tokens(server: str, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's logit bias (token ids as strings) and vLLM's min_tokens reach the engine."""
    tok = checkpoint.tokenizer
    token = tok.encode(" banana", add_special_tokens=False)
    assert len(token) == 1
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    _, forced, _, _ = post(server + "/v1/completions", {**body, "logit_bias": {str(token[0]): 100}})
    assert forced["choices"][0]["text"] == " banana" * 4
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0}
    _, short, _, _ = post(server + "/v1/chat/completions", {**chat, "max_tokens": 40})
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 30
    held = {**chat, "max_tokens": 40, "min_tokens": n + 5}
    _, longer, _, _ = post(server + "/v1/chat/completions", held)
    assert longer["usage"]["completion_tokens"] >= n + 5


def test_allowed_tokens_bad_words_and_the_stop_string_kept(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """vLLM's allowed_token_ids and bad_words change the greedy text exactly as plain decoding
    with the same settings does; include_stop_str_in_output keeps the stop string and the stop
    token's text."""
    tok = checkpoint.tokenizer
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    _, plain, _, _ = post(server + "/v1/completions", body)
    engine = SequentialEngine(model_fp32, max_model_len=256)

    def expected(**fields: Any) -> str:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **fields)
        return tok.decode(engine.generate(tok.encode(prompt), params).token_ids)

    allowed = sorted({*tok.encode(" 1, 2, 4, 5,", add_special_tokens=False)})
    _, out, _, _ = post(server + "/v1/completions", {**body, "allowed_token_ids": allowed})
    text = out["choices"][0]["text"]
    assert text == expected(allowed_token_ids=tuple(allowed)) != plain["choices"][0]["text"]
    assert " 3" not in text
    _, out, _, _ = post(server + "/v1/completions", {**body, "bad_words": ["2, 3"]})
    words = tuple(
        tuple(tok.encode(w, add_special_tokens=False)) for w in dict.fromkeys(["2, 3", " 2, 3"])
    )
    text = out["choices"][0]["text"]
    assert text == expected(bad_words=words) and "2, 3" not in text
    stop = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stop": [" 2"]}
    _, cut, _, _ = post(server + "/v1/completions", stop)
    _, kept, _, _ = post(server + "/v1/completions", {**stop, "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + " 2"
    first = tok.encode(plain["choices"][0]["text"], add_special_tokens=False)[0]
    at_token = {**body, "stop_token_ids": [first], "include_stop_str_in_output": True}
    _, kept, _, _ = post(server + "/v1/completions", at_token)
    assert kept["choices"][0]["text"] == tok.decode([first])
    for field, value in (
        ("allowed_token_ids", [10**9]),
        ("allowed_token_ids", []),
        ("bad_words", [" "]),
    ):
        code, out, _, _ = post(server + "/v1/completions", {**body, field: value})
        assert (code, out["error"]["param"]) == (400, field), (field, value)
    together = {**body, "allowed_token_ids": [5], "structured_outputs": {"regex": "a+"}}
    code, out, _, _ = post(server + "/v1/completions", together)
    assert (code, out["error"]["param"]) == (400, "allowed_token_ids")
    # Settings that leave no token: refused where that shows from the start (the only allowed
    # token is a bad word; only EOS, held off by min_tokens), else the answer stops where
    # nothing may come next ("1" alone, and never "111").
    (one,) = tok.encode("1", add_special_tokens=False)
    (eos,) = tok.eos_token_ids
    for fields in (
        {"allowed_token_ids": [one], "bad_words": ["1"]},
        {"allowed_token_ids": [eos], "min_tokens": 2, "ignore_eos": False},
    ):
        code, out, _, _ = post(server + "/v1/completions", {**body, **fields})
        assert (code, out["error"]["param"]) == (400, "allowed_token_ids"), fields
    ones = {**body, "allowed_token_ids": [one], "bad_words": ["111"]}
    code, out, _, _ = post(server + "/v1/completions", ones)
    assert code == 200 and out["choices"][0]["text"] == "11"
    assert out["choices"][0]["finish_reason"] == "stop"


def test_structured_output_in_openais_and_vllms_fields(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A JSON schema through the openai client's response_format, whole and streamed, is the
    greedy answer plain decoding gives under the same grammar; vLLM's fields hold a regex and
    a choice; json_object gives a JSON object."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    schema = NAME_AND_AGE
    messages = [{"role": "user", "content": PERSON_QUESTION}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format=response_format,  # type: ignore[arg-type]
    )
    text = reply.choices[0].message.content or ""
    person = json.loads(text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert reply.choices[0].finish_reason == "stop"
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256, tokenizer=tok
    )
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=compile_grammar("json", schema)
    )
    prompt_ids = tok.encode(tok.apply_chat_template(messages))
    assert text == tok.decode(plain.generate(prompt_ids, params).token_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format=response_format,  # type: ignore[arg-type]
    )
    assert "".join(e.choices[0].delta.content or "" for e in stream if e.choices) == text

    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    for extra, check in (
        ({"guided_regex": r" [A-Z][a-z]+\."}, lambda t: re.fullmatch(r" [A-Z][a-z]+\.", t)),
        ({"structured_outputs": {"choice": [" Paris", " Rome"]}}, lambda t: t == " Paris"),
        ({"guided_choice": [" Rome", " Oslo"]}, lambda t: t in (" Rome", " Oslo")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ):
        code, out, _, _ = post(server + "/v1/completions", {**body, **extra})
        assert code == 200, out
        assert check(out["choices"][0]["text"]), (extra, out["choices"][0]["text"])


TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]


def called(message: Any) -> list[tuple[str, Any]]:
    """An openai client message's tool calls, as (name, arguments)."""
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed_calls(chunks: list[Any]) -> tuple[str, list[tuple[str, Any]], str | None]:
    """A streamed answer's content, its tool calls (their deltas put together by index) and
    its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish


def test_tool_calls_forced_named_and_required(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A named tool_choice gets that function's call, whose arguments follow its schema and are
    the ones plain decoding writes under the same grammar, whole and streamed (finish "stop",
    as OpenAI's); required gets a call to one of the tools given (finish "tool_calls")."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 40}
    reply = client.chat.completions.create(**ask, tool_choice=named, temperature=0)
    choice = reply.choices[0]
    ((name, arguments),) = called(choice.message)
    assert name == "get_weather" and set(arguments) == {"city"}
    assert (choice.finish_reason, choice.message.content) == ("stop", None)
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256, tokenizer=tok
    )
    grammar = call_grammar([WEATHER, TIME], "get_weather", parallel=False)
    prompt_ids = tok.encode(render_prompt(tok, messages, TOOLS))
    text = tok.decode(
        plain.generate(
            prompt_ids, SamplingParams(max_tokens=40, temperature=0, structured=grammar)
        ).token_ids
    )
    assert text == block_text("get_weather", arguments)
    chunks = list(
        client.chat.completions.create(**ask, tool_choice=named, temperature=0, stream=True)
    )
    assert streamed_calls(chunks) == ("", [(name, arguments)], "stop")

    for temperature in (0, 1):  # (several calls would not fit this engine's 256 tokens)
        reply = client.chat.completions.create(
            **ask,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=temperature,
            seed=5,
        )
        ((name, _),) = called(reply.choices[0].message)
        assert name in ("get_weather", "get_time")
        assert reply.choices[0].finish_reason == "tool_calls"


def test_tool_calls_the_model_chooses(server: str, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """tool_choice auto: after a conversation whose turns called a tool (rendered into the
    bundled model's template), the model calls it again, parsed whole and streamed; a question
    it answers itself is plain decoding's text over the prompt that shows the tools; with
    parallel_tool_calls false an answer holds one call."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    history: list[dict[str, Any]] = []
    for number, city in enumerate(("Rome", "London")):
        call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
        history += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call_{number}", "type": "function", "function": call}],
            },
        ]
    messages = [*history, {"role": "user", "content": "Weather in Paris?"}]
    # One short tool: the conversation must fit this engine's 256 tokens.
    weather = {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}}}
    tools = [{"type": "function", "function": weather}]
    ask: dict[str, Any] = {"model": MODEL, "tools": tools, "max_tokens": 40, "temperature": 0}
    reply = client.chat.completions.create(**ask, messages=messages)
    assert called(reply.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**ask, messages=messages, stream=True))
    assert streamed_calls(chunks) == ("", [("get_weather", {"city": "Paris"})], "tool_calls")
    single = client.chat.completions.create(**ask, messages=messages, parallel_tool_calls=False)
    assert called(single.choices[0].message) == [("get_weather", {"city": "Paris"})]
    assert single.choices[0].finish_reason == "tool_calls"

    question = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(**{**ask, "max_tokens": 12}, messages=question)
    prompt_ids = tok.encode(render_prompt(tok, question, tools))
    answer = plain_greedy(model_fp32, checkpoint, prompt_ids, 12)
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == (
        tok.decode(answer),
        [],
    )
    assert reply.choices[0].finish_reason == ("stop" if len(answer) < 12 else "length")


def test_auto_tool_choice_with_a_json_output_calls_or_answers_in_the_schema(
    server: str, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """tool_choice auto with a response_format schema: the answer is calls, or JSON that
    follows the schema; each is what plain decoding writes under the same grammar."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    tok = checkpoint.tokenizer
    weather = {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}}}
    tools = [{"type": "function", "function": weather}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": NAME_AND_AGE}}
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256, tokenizer=tok
    )

    def under_grammar(messages: list[dict[str, Any]], n: int, parallel: bool = True) -> str:
        prompt_ids = tok.encode(render_prompt(tok, messages, tools))
        grammar = call_grammar([weather], None, parallel, answer=NAME_AND_AGE)
        params = SamplingParams(max_tokens=n, temperature=0, structured=grammar)
        return tok.decode(plain.generate(prompt_ids, params).token_ids)

    ask: dict[str, Any] = {"model": MODEL, "tools": tools, "response_format": schema}
    question = [{"role": "user", "content": PERSON_QUESTION}]
    reply = client.chat.completions.create(**ask, messages=question, max_tokens=30, temperature=0)
    message = reply.choices[0].message
    assert message.content == under_grammar(question, 30) and not message.tool_calls
    assert set(json.loads(message.content)) == {"name", "age"}
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_0", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    reply = client.chat.completions.create(
        **ask, messages=history, max_tokens=30, temperature=0, parallel_tool_calls=False
    )
    text = under_grammar(history, 30, parallel=False)
    assert text.startswith("<tool_call>")  # after a call in the conversation, it calls again
    content, calls = read_answer(ToolCalling(("get_weather",), forced=True), text)
    message = reply.choices[0].message
    assert message.content == content is None
    assert [c.function.arguments for c in message.tool_calls] == [
        c["function"]["arguments"] for c in calls
    ]
    assert reply.choices[0].finish_reason == "tool_calls"


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(server: str) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none the first time a prompt is
    seen, its whole blocks (all but the last token's) the next."""
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    prompt = "A prompt no other test sends, long enough to fill two cache blocks of sixteen."
    first, again = (
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0


def test_special_tokens_shown_on_request(server: str) -> None:
    """vLLM's skip_special_tokens: false shows special tokens in the text (here one a grammar
    forces), but never the EOS that ends it."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    forced = {**body, "structured_outputs": {"grammar": 'start: <[1]> " yes"'}}
    texts = [
        post(server + "/v1/completions", {**forced, "skip_special_tokens": shown})[1]
        for shown in (False, True)
    ]
    assert [t["choices"][0]["text"] for t in texts] == ["<|im_start|> yes", " yes"]
    url = server + "/v1/chat/completions"
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 40}
    chat["temperature"] = 0
    plain = post(url, chat)[1]["choices"][0]
    shown = post(url, {**chat, "skip_special_tokens": False})[1]["choices"][0]
    assert plain["finish_reason"] == shown["finish_reason"] == "stop"
    assert shown["message"]["content"] == plain["message"]["content"]


def test_tokenize_and_detokenize(server: str, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """vLLM's /tokenize counts a prompt as completions see it, and a conversation (with the
    tools it shows) as chat completions do; /detokenize gives the text back."""
    tok = checkpoint.tokenizer
    code, out, _, _ = post(server + "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    ids = tok.encode(PROMPT)
    assert code == 200, out
    assert out == {
        "count": len(ids),
        "max_model_len": 256,
        "tokens": ids,
        "token_strs": [tok.token_text(t) for t in ids],
    }
    conversation = {
        "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
        "tools": [{"type": "function", "function": WEATHER}],
    }
    _, counted, _, _ = post(server + "/tokenize", conversation)
    _, reply, _, _ = post(server + "/v1/chat/completions", {**conversation, "max_tokens": 1})
    assert counted["count"] == reply["usage"]["prompt_tokens"] and counted["token_strs"] is None
    _, opened, _, _ = post(server + "/tokenize", {**conversation, "add_generation_prompt": False})
    assert counted["tokens"][: opened["count"]] == opened["tokens"]
    assert opened["count"] < counted["count"]
    code, out, _, _ = post(server + "/detokenize", {"tokens": counted["tokens"]})
    assert code == 200 and out["prompt"] == tok.decode(counted["tokens"])
    assert "get_weather" in out["prompt"]
    for path, body, status, param in (
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", **conversation}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "tools": conversation["tools"]}, 400, "tools"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ):
        code, out, _, _ = post(server + path, body)
        assert (code, out["error"]["param"]) == (status, param), (path, body)
