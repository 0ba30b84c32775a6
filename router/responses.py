"""OpenAI's Responses API (`POST /v1/responses`) on the chat machinery.

A Responses request is a chat completion in other clothes. Its `input` items (messages, function
calls and their outputs) and `instructions` become a conversation; `tools`, `tool_choice` and
`text.format` become chat's tools and response format; the sampling fields carry over. So the
prompt, the grammar of a forced call or a schema, speculation and routing are chat's
(router/protocol.py, router/tools.py). The answer's text and tool calls become output items: a
`message` holding one `output_text` part, and a `function_call` per call, in the order the model
wrote them.

`ResponseBuilder` reads the answer step by step, as the engine commits it, and both builds the
items and yields the stream's semantic events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`), each with its `sequence_number`. The whole (not streamed) answer is built
by the same steps, so it is what the stream's events put together give.

With `store` (the default, as OpenAI's) the response, and the items that led to it, stay in Redis
for an hour (`state.RESPONSE_TTL_S`): any replica answers `GET /v1/responses/{id}`, and a
request's `previous_response_id` continues that conversation (its earlier input and output items
come before the new input; its `instructions` do not carry over, as in OpenAI's).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field

from router import errors
from router.schemas import ChatCompletionRequest, SpeculativeOptions, Strict, validate
from router.tools import Piece, ToolCalling, ToolCallParser, finish_reason

# Content part types whose text a message may carry (an assistant's earlier output included).
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesTool(Strict):
    type: Literal["function"] = Field(description="only function tools are served")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the function's name")
    description: str | None = Field(None, description="what it does, shown to the model")
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its arguments")
    strict: bool | None = Field(None, description="accepted; forced calls follow the schema")


class FunctionToolChoice(Strict):
    type: Literal["function"] = Field(description="only functions")
    name: str = Field(description="one of the tools' names")


class TextFormat(Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = Field(description="the output's form")
    name: str | None = Field(None, description="json_schema: the schema's name")
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="json_schema: the schema"
    )
    description: str | None = Field(None, description="json_schema: accepted")
    strict: bool | None = Field(None, description="json_schema: accepted, always held to")


class TextConfig(Strict):
    format: TextFormat | None = Field(
        None, description="text (default), json_object or json_schema"
    )


class ResponsesRequest(Strict):
    model: str | None = Field(None, description="the served model's id")
    input: str | list[dict[str, Any]] = Field(
        description="text (a user message), or items: messages, function_call and "
        "function_call_output"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    previous_response_id: str | None = Field(
        None, description="continue a stored response's conversation"
    )
    max_output_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0, le=2, description="0..2; 0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling")
    tools: list[ResponsesTool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a function"
    )
    parallel_tool_calls: bool = Field(True, description="false: one tool call at most")
    text: TextConfig | None = Field(None, description="the output's format")
    stream: bool = Field(False, description="server-sent semantic events")
    store: bool = Field(True, description="keep the response for GET and previous_response_id")
    metadata: dict[str, str] | None = Field(None, description="kept with the response")
    user: str | None = Field(
        None, description="an end-user id: the tenant fair share goes by where no API key is"
    )
    # Extensions, as chat completions take them.
    priority: int | None = Field(None, description="lower runs first (as chat completions')")
    seed: int | None = Field(None, description="seeded sampling")
    top_k: int | None = Field(None, description="top-k filtering (0 or -1: off)")
    min_p: float | None = Field(None, description="min-p filtering")
    repetition_penalty: float | None = Field(None, description="vLLM's repetition penalty")
    speculative: SpeculativeOptions | None = Field(None, description="Outrider's extension")
    # Asked for, but not served: refused when set.
    reasoning: dict[str, Any] | None = Field(None, description="not served (no reasoning model)")
    background: bool | None = Field(None, description="not served: only false")
    include: list[str] | None = Field(None, description="not served: only empty")
    top_logprobs: int | None = Field(None, description="not served: only 0")


def chat_request(
    body: ResponsesRequest, earlier: Sequence[Mapping[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion a Responses request asks for, and its input items (those of the
    conversation it continues, `earlier`, then its own)."""
    for field in ("reasoning", "include"):
        if getattr(body, field):
            raise errors.bad_request(f"{field} is not supported", field)
    if body.background:
        raise errors.bad_request("background responses are not supported", "background")
    if body.top_logprobs:
        raise errors.bad_request("top_logprobs is not supported", "top_logprobs")
    if isinstance(body.input, str):
        own: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": body.input}]
    else:
        own = [dict(item) for item in body.input]
    if not own and not earlier:
        raise errors.bad_request("input must not be empty", "input")
    messages = conversation(own, "input")
    history = conversation(earlier, "previous_response_id")
    if body.instructions:
        history.insert(0, {"role": "system", "content": body.instructions})
    chat: dict[str, Any] = {"messages": history + messages, "stream": body.stream}
    chat["store"] = body.store  # false: the registry forgets the request too
    if body.model is not None:
        chat["model"] = body.model
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    fields = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")
    for field in (*fields, "priority", "user"):
        if (value := getattr(body, field)) is not None:
            chat[field] = value
    if body.speculative is not None:
        chat["speculative"] = body.speculative.model_dump(exclude_none=True)
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    form = body.text.format if body.text else None
    if form is not None and form.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None:
            raise errors.bad_request("a json_schema format needs its schema", "text.format.schema")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": form.name or "response", "schema": form.json_schema},
        }
    return validate(ChatCompletionRequest, chat), own


# Chat request fields and the Responses fields they come from.
_FIELDS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
)


def in_our_terms(error: errors.RouterError) -> errors.RouterError:
    """A refusal of the chat request a Responses request became, naming the Responses field
    it came from (`input` for any message: instructions and stored items come before it)."""
    param = error.param
    if param is None:
        return error
    for chat, ours in _FIELDS:
        if param == chat or param.startswith(chat + "."):
            error.param = ours
            return error
    parts = param.split(".")
    if parts[0] == "tools" and len(parts) > 2 and parts[2] == "function":  # tools.0.function.x
        error.param = ".".join(parts[:2] + parts[3:])
    return error


def conversation(items: Sequence[Mapping[str, Any]], param: str) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before it (or
    starts one), a function call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{param}.{index}" if param == "input" else param
        if not isinstance(item, Mapping):
            raise errors.bad_request("an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise errors.bad_request(
                    f"role must be one of {', '.join(_ROLES)}", f"{where}.role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, where) for key in _CALL)
            function = {"name": name, "arguments": arguments}
            call = {"id": call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = _text(item.get("output"), where, "output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise errors.bad_request(
                f"input items of type {kind!r} are not served", f"{where}.type"
            )
    return messages


_CALL = ("call_id", "name", "arguments")


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise errors.bad_request(f"{key} must be a string", f"{where}.{key}")
    return value


def _text(content: Any, where: str, key: str = "content") -> str:
    """A message's content (or a call output's): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.bad_request(f"{key} must be a string or a list of parts", f"{where}.{key}")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise errors.bad_request("only text parts are served", f"{where}.{key}.{number}")
        texts.append(part["text"])
    return "".join(texts)


class ResponseBuilder:
    """Builds one response from its answer's steps: the output items, and the stream events
    that build them (`step` and `finish` return those events)."""

    def __init__(
        self,
        body: ResponsesRequest,
        response_id: str,
        model: str,
        calling: ToolCalling | None,
    ) -> None:
        self.parser = None if calling is None else ToolCallParser(calling)
        self.response: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "tool_choice": _tool_choice(body),
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": {"format": _format(body)},
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": None,
        }
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written

    @property
    def output(self) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = self.response["output"]
        return output

    def start(self) -> list[dict[str, Any]]:
        snapshot = {**self.response, "output": []}
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def step(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """One step's text (the answer's end when `finished`): its events."""
        if self.parser is None:
            pieces: list[Piece] = [text] if text else []
        else:
            pieces = self.parser.read(text)
            if finished:
                pieces += self.parser.read_end()
        events = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self._text(piece)
                continue
            if "id" in piece:
                events += self._close()
                events += self._open_call(piece["id"], piece["function"]["name"])
            if piece["function"]["arguments"]:
                events += self._arguments(piece["function"]["arguments"])
        return events

    def finish(self, reason: str | None, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The answer ended (engine finish reason `reason`): the last item's end and the
        response's."""
        events = self._close()
        calls = sum(item["type"] == "function_call" for item in self.output)
        calling = None if self.parser is None else self.parser.calling
        reason = reason if calling is None else finish_reason(calling, reason, calls)
        if reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.response["status"] = "completed"
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        self.response["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
            "speculative": usage["speculative"],  # Outrider's extension, as in chat's usage
        }
        kind = "response.incomplete" if reason == "length" else "response.completed"
        return [*events, self._event(kind, response=self.response)]

    def failed(self, error: errors.RouterError) -> dict[str, Any]:
        """The event of a stream that failed after it began."""
        self.response["status"] = "failed"
        self.response["error"] = {"code": error.kind, "message": error.message}
        return self._event("response.failed", response=self.response)

    # -- items --------------------------------------------------------------------------------

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            item: dict[str, Any] = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events += self._add(item)
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._where(), part=part))
            item["content"].append(part)
        self._open["content"][0]["text"] += text  # type: ignore[index]
        events.append(
            self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])
        )
        return events

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        return self._add(item)

    def _arguments(self, piece: str) -> list[dict[str, Any]]:
        assert self._open is not None and self._open["type"] == "function_call"
        self._open["arguments"] += piece
        where = self._where()
        del where["content_index"]
        return [self._event("response.function_call_arguments.delta", **where, delta=piece)]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=item)]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {
            "item_id": self._open["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event, holding a copy of what it shows as it is now: items and parts change as
        the answer goes on, and a stream may send the event after that (as `step` returns all
        of a step's events at once)."""
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event


def _tool_choice(body: ResponsesRequest) -> Any:
    if isinstance(body.tool_choice, FunctionToolChoice):
        return body.tool_choice.model_dump()
    return body.tool_choice or ("auto" if body.tools else "none")


def _format(body: ResponsesRequest) -> dict[str, Any]:
    form = body.text.format if body.text else None
    if form is None:
        return {"type": "text"}
    return form.model_dump(by_alias=True, exclude_none=True)


def stored_items(own: list[dict[str, Any]], response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A finished response's output items as input items, after the input that led to them:
    what a later `previous_response_id` continues."""
    items = list(own)
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        else:
            items.append({key: item[key] for key in ("type", *_CALL)})
    return items
