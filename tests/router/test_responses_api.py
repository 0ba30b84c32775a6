"""OpenAI's Responses API on loopback through the official `openai` client (real Redis, one
in-process engine): text and function calls, whole and streamed, against plain decoding over the
conversation they stand for; stored responses and previous_response_id; refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.tools import render_prompt
from tests.model.helpers import NAME_AND_AGE, PERSON_QUESTION, WEATHER
from tests.router.helpers import MODEL, get, post, sse_events
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", **WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def client(open_router) -> Any:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=open_router.url + "/v1", api_key="unused")


def greedy(model_fp32, checkpoint, messages, n: int, tools=None) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    """Plain decoding's answer to a conversation rendered as chat completions render it: the
    prompt's ids and the answer's text."""
    tok = checkpoint.tokenizer
    prompt = tok.encode(render_prompt(tok, messages, tools))
    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256
    )
    answer = engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0)).token_ids
    return prompt, tok.decode(answer)


def test_a_text_response_whole_and_streamed(client, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The output text is plain decoding's over the instructions and input as a conversation;
    the stream's events build the same response, numbered in order."""
    ask = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
    instructions, question = "Answer in one sentence.", "Name a colour."
    reply = client.responses.create(**ask, instructions=instructions, input=question)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    prompt, expected = greedy(model_fp32, checkpoint, messages, 12)
    assert reply.output_text == expected
    assert reply.id.startswith("resp_") and reply.object == "response"
    (message,) = reply.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert reply.usage.input_tokens == len(prompt) and reply.usage.output_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    incomplete = reply.usage.output_tokens == 12
    assert reply.status == ("incomplete" if incomplete else "completed")
    if incomplete:
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.instructions == instructions and reply.temperature == 0

    events = list(
        client.responses.create(**ask, instructions=instructions, input=question, stream=True)
    )
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if incomplete else "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and "".join(deltas) == expected
    final = events[-1].response
    assert final.output_text == expected and final.usage.input_tokens == len(prompt)
    assert events[-2].item.id == events[2].item.id == final.output[0].id


def test_function_calls_forced_and_answered(client, model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A named function gives one function_call item with chat's arguments for the same
    request, streamed in pieces; its output sent back with previous_response_id continues the
    conversation (the call and its result rendered as chat renders them)."""
    question = "What is the weather like in Paris?"
    choice = {"type": "function", "name": "get_weather"}
    ask = {"model": MODEL, "input": question, "tools": TOOLS, "tool_choice": choice}
    reply = client.responses.create(**ask, temperature=0, max_output_tokens=40)
    (call,) = reply.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and reply.status == "completed"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments

    events = list(client.responses.create(**ask, temperature=0, max_output_tokens=40, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.arguments, done.name) == (call.arguments, "get_weather")
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=reply.id,
        input=[result],
        tools=TOOLS,
        temperature=0,
        max_output_tokens=8,
    )
    messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    prompt, expected = greedy(model_fp32, checkpoint, messages, 8, CHAT_TOOLS)
    assert follow.usage.input_tokens == len(prompt)
    assert follow.previous_response_id == reply.id
    if follow.output and follow.output[0].type == "message":
        assert follow.output_text == expected


def test_stored_responses_continue_and_can_be_read_and_deleted(
    client, open_router, model_fp32, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}
    first = client.responses.create(**ask, instructions="Be brief.", input="Name a fruit.")
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(**ask, previous_response_id=first.id, input="And a vegetable?")
    # The earlier instructions do not carry over; its input and output do.
    messages = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a vegetable?"},
    ]
    prompt, expected = greedy(model_fp32, checkpoint, messages, 6)
    assert (second.usage.input_tokens, second.output_text) == (len(prompt), expected)
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)  # deleted already
    code, out = get(f"{open_router.url}/v1/responses/{first.id}")
    assert (code, out["error"]["type"]) == (404, "not_found_error")
    unstored = client.responses.create(**ask, input="Hi", store=False)
    assert get(f"{open_router.url}/v1/responses/{unstored.id}")[0] == 404
    code, out, _, _ = post(
        open_router.url + "/v1/responses", {"input": "Hi", "previous_response_id": unstored.id}
    )
    assert (code, out["error"]["param"]) == (404, "previous_response_id")


def test_a_json_schema_format_holds_the_output_text(client) -> None:  # type: ignore[no-untyped-def]
    form = {"type": "json_schema", "name": "person", "schema": NAME_AND_AGE, "strict": True}
    reply = client.responses.create(
        model=MODEL,
        input=PERSON_QUESTION,
        text={"format": form},
        temperature=0,
        max_output_tokens=40,
    )
    person = json.loads(reply.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            400,
            "input.0.call_id",
        ),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
        ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi " * 300}, 400, "input"),  # past the context
        ({"input": "hi", "max_output_tokens": 300}, 400, "input"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
            400,
            "text.format",
        ),
        (
            {
                "input": "hi",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": 3}}],
                "tool_choice": "required",
            },
            400,
            "tools",
        ),
        ({"input": "hi", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
        ({"input": "hi", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_refusals_name_their_field(
    open_router, body: dict[str, Any], status: int, param: str
) -> None:  # type: ignore[no-untyped-def]
    code, out, _, _ = post(open_router.url + "/v1/responses", body)
    assert (code, out["error"]["param"]) == (status, param), out


def test_the_raw_stream_is_typed_sse_without_done(open_router) -> None:  # type: ignore[no-untyped-def]
    body = {"input": "Hi", "max_output_tokens": 3, "stream": True, "temperature": 0}
    code, _, raw, _ = post(open_router.url + "/v1/responses", body)
    assert code == 200
    names = [
        line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")
    ]
    events = sse_events(raw)
    assert "[DONE]" not in events and names == [event["type"] for event in events]
