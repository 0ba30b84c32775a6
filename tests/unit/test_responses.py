"""The Responses API's pieces without a server (router/responses.py): input items as a
conversation, and the builder of output items and stream events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router import errors
from router.responses import (
    ResponseBuilder,
    ResponsesRequest,
    conversation,
    in_our_terms,
    stored_items,
)
from router.schemas import validate
from router.tools import ToolCalling

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def built(steps: list[str], calling: ToolCalling | None, reason: str = "stop") -> Any:
    """The response, and its events as a stream sends them: serialized when each call returns,
    before the next step."""
    body = validate(ResponsesRequest, {"input": "hi"})
    builder = ResponseBuilder(body, "resp_1", "smol", calling)

    def sent(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(event)) for event in events]

    events = sent(builder.start())
    for number, text in enumerate(steps):
        events += sent(builder.step(text, finished=number == len(steps) - 1))
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "speculative": {}}
    events += sent(builder.finish(reason, usage))
    return builder.response, events


@pytest.mark.parametrize("cut", [1, 5, 14, 20, 40])
def test_items_follow_the_order_the_model_wrote_them(cut: int) -> None:
    """Text, a call, more text: three items, whatever the steps; the stream's finished items
    are the response's, and its events are numbered in order."""
    text = f"Let me check. {CALL}\nDone."
    response, events = built([text[:cut], text[cut:]], ToolCalling(("get_weather",)))
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["message", "function_call", "message"]
    assert response["output"][0]["content"][0]["text"] == "Let me check."
    assert response["output"][1]["arguments"] == '{"city": "Oslo"}'
    assert response["output"][2]["content"][0]["text"] == "Done."
    assert response["status"] == "completed" and response["usage"]["input_tokens"] == 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == response["output"]
    last = {"type": "response.completed", "sequence_number": len(events) - 1, "response": response}
    assert events[-1] == last


def replayed(sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output a client builds from a stream's events, as OpenAI's SDK accumulates them: the
    item as added, its parts as added, then the deltas (the done events are not read)."""
    output: list[dict[str, Any]] = []
    for event in sent:
        if event["type"] == "response.output_item.added":
            output.append(event["item"])
        elif event["type"] == "response.content_part.added":
            output[event["output_index"]]["content"].append(event["part"])
        elif event["type"] == "response.output_text.delta":
            output[event["output_index"]]["content"][event["content_index"]]["text"] += event[
                "delta"
            ]
        elif event["type"] == "response.function_call_arguments.delta":
            output[event["output_index"]]["arguments"] += event["delta"]
    return output


@pytest.mark.parametrize("cut", [1, 5, 14, 20, 40])
def test_events_as_sent_build_the_response(cut: int) -> None:
    """Each step's events go out (serialized) before the next step: an item is added empty and
    a part with no text, so that the deltas a client adds up give the response's text once."""
    text = f"Let me check. {CALL}\nDone."
    response, sent = built([text[:cut], text[cut:]], ToolCalling(("get_weather",)))
    added = [e for e in sent if e["type"] == "response.content_part.added"]
    assert [e["part"]["text"] for e in added] == ["", ""]
    messages = [e["item"] for e in sent if e["type"] == "response.output_item.added"]
    assert [m.get("content") for m in messages] == [[], None, []]
    built_up = replayed(sent)
    final = response["output"]
    assert [item["type"] for item in built_up] == [item["type"] for item in final]
    assert built_up[0]["content"] == final[0]["content"]
    assert built_up[1]["arguments"] == final[1]["arguments"]
    assert built_up[2]["content"] == final[2]["content"]


def test_a_cut_answer_is_incomplete() -> None:
    response, events = built(["Once upon"], None, reason="length")
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


def test_input_items_as_a_conversation_and_back() -> None:
    parts = [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]
    items = [
        {"role": "user", "content": parts},
        {"type": "message", "role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{**parts[1], "text": "noon"}]},
    ]
    messages = conversation(items, "input")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == "Weather in Oslo?"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # one assistant turn
    assert messages[3] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}
    lone = conversation([items[2]], "input")
    assert lone[0]["content"] is None and lone[0]["tool_calls"][0]["id"] == "c1"
    response, _ = built([f"Sure. {CALL}"], ToolCalling(("get_weather",)))
    again = stored_items(items[:1], response)
    assert again[1:] == [
        {"type": "message", "role": "assistant", "content": "Sure."},
        {
            "type": "function_call",
            "call_id": response["output"][1]["call_id"],
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
    ]
    assert conversation(again, "previous_response_id")[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }


@pytest.mark.parametrize(
    ("chat", "ours"),
    [
        ("messages.3.content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema", "text.format"),
        ("tools.1.function.name", "tools.1.name"),
        ("tool_choice", "tool_choice"),
        (None, None),
    ],
)
def test_a_chat_refusal_names_the_responses_field(chat: str | None, ours: str | None) -> None:
    assert in_our_terms(errors.bad_request("no", chat)).param == ours
