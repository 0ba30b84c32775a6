"""Tool calling (OpenAI's `tools` and `tool_choice`): the prompt that shows the tools, the
grammar that holds a forced call to its function's schema, and the parser that turns an answer's
calls into `tool_calls`.

A tool call is written in one text format, a Hermes-style block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5 and Hermes models write these natively; the bundled model follows them when the prompt
shows the format (and, reliably, when the conversation has calls in it already).

- Prompt: a chat template that takes `tools` (it names the variable) renders the tools, and
  the conversation's calls and results, itself. For one that does not, the tools and the
  format go into the system message, earlier calls are written as blocks in the assistant's
  turn and tool results as `<tool_response>` blocks in a user turn.
- Grammar: `tool_choice` "required" or a named function holds the answer to such blocks (one
  block for a named function or with `parallel_tool_calls` false) whose JSON is
  `{"name": ..., "arguments": ...}` with the arguments following the function's parameter
  schema. It is a structured output like `response_format`'s, so speculation under it stays
  exact and the EAGLE drafter drafts inside it. `auto` with a JSON output (a schema) is one
  grammar of both: such calls, or JSON that follows the schema.
- Parser: a block holding a JSON object that names a known function becomes a tool call; the
  text outside blocks is the message's content. A block that does not parse (`auto`, where
  nothing holds the model to the format) stays content, as in vLLM. Streaming holds back text
  that may begin a block. Under `auto` it sends each call whole when its block closes; under a
  forced call (the grammar guarantees the format) a call opens as soon as its arguments begin,
  and they stream as written.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine.structured import JSON_DEFAULTS, StructuredOutput, compile_grammar
from workers.model.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# For templates that do not render tools: the system message's part that shows them.
_INSTRUCTIONS = """You can call these functions:
<tools>
{tools}
</tools>
To call a function, answer with its name and arguments as JSON inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "function name", "arguments": {{"argument": "value"}}}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How a chat answer's tool calls are read: the functions it may call, and whether the
    request named the one to call (the answer then finishes with "stop", as OpenAI's does,
    rather than "tool_calls")."""

    names: tuple[str, ...]
    named: bool = False
    # A grammar holds the answer's blocks to the format: required, a named function, or auto
    # with a JSON output (the answer is then calls, or that JSON).
    forced: bool = False


def render_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt for a conversation whose messages may hold tool calls (assistant
    `tool_calls`) and results (role `tool`), showing the model `tools` (OpenAI's
    `{"type": "function", "function": {...}}` entries) when given. The other arguments are
    `Tokenizer.apply_chat_template`'s."""
    options: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "template_kwargs": template_kwargs,
    }
    if tokenizer.takes_tools:
        # Such templates take each call's arguments as an object (Hugging Face's convention).
        native = [_arguments_as_objects(m) for m in messages]
        return tokenizer.apply_chat_template(native, tools=tools, **options)
    return tokenizer.apply_chat_template(_folded(messages, tools), **options)


def _arguments_as_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    native = []
    for call in calls:
        function = call["function"]
        native.append({**call, "function": {**function, "arguments": _loads(function)}})
    return {**message, "tool_calls": native}


def _loads(function: Mapping[str, Any]) -> Any:
    try:
        return json.loads(function["arguments"])
    except json.JSONDecodeError:
        return function["arguments"]


def _folded(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """The conversation in plain system/user/assistant turns: tools in the system message,
    calls as blocks, consecutive tool results as one user turn of `<tool_response>` blocks."""
    turns: list[dict[str, str]] = []
    results = False  # the last turn holds tool results
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block})
            results = True
            continue
        calls = message.get("tool_calls") or ()
        blocks = [block_text(c["function"]["name"], _loads(c["function"])) for c in calls]
        turns.append({"role": role, "content": "\n".join(([content] if content else []) + blocks)})
        results = False
    if tools:
        shown = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        instructions = _INSTRUCTIONS.format(tools=shown)
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{instructions}"
        else:
            turns.insert(0, {"role": "system", "content": instructions})
    return turns


def block_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{call}\n{CLOSE}"


def call_grammar(
    functions: Sequence[Mapping[str, Any]],
    name: str | None,
    parallel: bool,
    tokenizer: Tokenizer | None = None,
    answer: Mapping[str, Any] | None = None,
) -> StructuredOutput:
    """The grammar of an answer that is tool calls only: of the function `name` (once), or of
    any of `functions` (OpenAI's function definitions; more than one call when `parallel`).
    With `answer` (a JSON schema: `auto` with a structured output) the answer may instead be
    JSON that follows it. Where `tokenizer` has a tag as a token of its own (Qwen2.5's
    `<tool_call>`), the grammar asks for that token. ValueError when a function's parameter
    schema, or the answer's, does not compile."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    definitions: dict[str, Any] = {}
    options = []
    for function in chosen:
        parameters = dict(function.get("parameters") or {"type": "object"})
        for key in ("$defs", "definitions"):  # a reference names them from the schema's root
            for def_name, definition in parameters.pop(key, {}).items():
                if definitions.setdefault(f"{key}/{def_name}", definition) != definition:
                    raise ValueError(f"two functions define {key}/{def_name} differently")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    for path, shared in definitions.items():
        key, def_name = path.split("/", 1)
        schema.setdefault(key, {})[def_name] = shared
    schema["x-guidance"] = JSON_DEFAULTS
    more = ' ("\\n" call)*' if parallel and name is None else ""
    opening, closing = _tag(OPEN, tokenizer), _tag(CLOSE, tokenizer)
    lark = f'calls: call{more}\ncall: {opening} "\\n" %json {json.dumps(schema)} "\\n" {closing}'
    if answer is None:
        return compile_grammar("grammar", f"start: calls\n{lark}")
    answer = {"x-guidance": JSON_DEFAULTS, **answer}  # its own options win
    lark += f"\nanswer: %json {json.dumps(answer)}"
    return compile_grammar("grammar", f"start: calls | answer\n{lark}")


def _tag(text: str, tokenizer: Tokenizer | None) -> str:
    """A tag in Lark: a reference to its token where the tokenizer added it as one (llguidance
    reads every added token as a special token, which no string literal matches), else the
    string (Lark's literals take JSON's escapes)."""
    token_id = None if tokenizer is None else tokenizer.added_token_id(text)
    return json.dumps(text) if token_id is None else f"<[{token_id}]>"


def _whitespace_tail(text: str) -> int:
    return len(text) - len(text.rstrip())


def _open_prefix(text: str) -> int:
    """Length of the longest end of `text` that begins `OPEN`."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


# The start of a block's JSON up to its arguments' first character: `{"name": "f", "arguments": `.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class _ObjectEnd:
    """Finds where a JSON object that arrives in pieces ends (brackets outside strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The length of `text` up to and with the object's last character, if it is there."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


# What a parser reads from an answer, in order: content (text) and tool-call deltas.
Piece = str | dict[str, Any]


class ToolCallParser:
    """Reads one answer's text as it comes: `feed` gives the content that can be sent now and
    the tool-call deltas (OpenAI's streaming `tool_calls` entries, by `index`) it completes;
    `finish` the rest. `read` and `read_end` give the same as one list in the order the answer
    holds them (what the Responses API's items follow). Whitespace around blocks is not
    content. The concatenated content of an answer without a call is its text, unchanged.

    Under `auto` a block may turn out not to be a call, so each call comes whole, in one delta,
    when its block closes. Under a forced call the grammar holds every block to the format: a
    call opens (id and name) as soon as its arguments begin, and they follow in pieces, as the
    model writes them."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._names = set(calling.names)
        self._buffer = ""
        self._inside = False  # the buffer starts with an open block
        self._after_block = False  # whitespace at the buffer's start follows a call
        self._space = ""  # the whitespace before the open block
        self._arguments: _ObjectEnd | None = None  # streaming the open call's arguments
        self._ended = False  # the open block's call is complete: skip to its end tag
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return _split(self.read(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return _split(self.read_end())

    def read(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._after_block:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._after_block = False
            if self._inside:
                if not self._inside_block(pieces):
                    break
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                # Hold back what may begin a block, and the whitespace before it.
                held = _open_prefix(self._buffer)
                ready = self._buffer[: len(self._buffer) - held]
                held += _whitespace_tail(ready)
                pieces.append(self._buffer[: len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held :]
                break
            before = self._buffer[:start]
            pieces.append(before.rstrip())
            self._space = before[len(before.rstrip()) :]  # content again if no call follows
            self._buffer, self._inside = self._buffer[start:], True
        return _merged(pieces)

    def read_end(self) -> list[Piece]:
        """The end of the answer: an unclosed block is a call if it reads as one (the answer
        may stop at `</tool_call>` itself), or if its arguments were streaming (a call cut
        short by max_tokens keeps what it has, as OpenAI's does)."""
        rest, self._buffer = self._buffer, ""
        pieces: list[Piece] = []
        if self._inside:
            self._inside = False
            if self._arguments is None and not self._ended:
                self._read(rest, rest[len(OPEN) :], pieces)
            self._arguments, self._ended = None, False
        elif not self._after_block:
            pieces.append(rest)
        return _merged(pieces)

    def _inside_block(self, pieces: list[Piece]) -> bool:
        """Take what the buffer holds of the open block; whether the block is done (else more
        text is needed)."""
        if self._arguments is not None:
            end = self._arguments.feed(self._buffer)
            piece = self._buffer if end is None else self._buffer[:end]
            self._buffer = self._buffer[len(piece) :]
            if piece:
                pieces.append({"index": self.num_calls - 1, "function": {"arguments": piece}})
            if end is None:
                return False
            self._arguments, self._ended = None, True
        close = self._buffer.find(CLOSE)
        if self._ended:  # what follows the arguments (the object's brace) is not shown
            if close < 0:
                return False
            self._buffer = self._buffer[close + len(CLOSE) :]
            self._inside, self._ended, self._after_block = False, False, True
            return True
        if self.calling.forced and (header := _HEADER.match(self._buffer, len(OPEN))):
            name = header.group(1)
            if name in self._names and self._buffer[header.end()] == "{":
                pieces.append(self._opened(name, ""))
                self._buffer = self._buffer[header.end() :]
                self._arguments = _ObjectEnd()
                return True
        if close < 0:
            return False
        block = self._buffer[: close + len(CLOSE)]
        self._buffer = self._buffer[close + len(CLOSE) :]
        self._inside = False
        self._read(block, block[len(OPEN) : -len(CLOSE)], pieces)
        return True

    def _opened(self, name: str, arguments: str) -> dict[str, Any]:
        """The first delta of a call (the whole call when `arguments` are all of them)."""
        self.num_calls += 1
        return {
            "index": self.num_calls - 1,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _read(self, block: str, body: str, pieces: list[Piece]) -> None:
        """A closed (or, at the end, unclosed) block: a call, or else content as written."""
        call = self._call(body)
        if call is None:
            pieces.append(self._space + block)
            return
        pieces.append(self._opened(*call))
        self._after_block = True

    def _call(self, body: str) -> tuple[str, str] | None:
        """A whole block's name and arguments (as JSON text), if it is a call."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not isinstance(name, str) or name not in self._names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments' JSON as a string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content as one piece (empty content dropped), and adjacent deltas of one call
    as one delta (its opening and the first of its arguments)."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, str):
            if not piece:
                continue
            if isinstance(last, str):
                out[-1] = last + piece
                continue
        elif isinstance(last, dict) and last["index"] == piece["index"]:
            function = {**last["function"]}
            function["arguments"] += piece["function"]["arguments"]
            out[-1] = {**last, "function": function}
            continue
        out.append(piece)
    return out


def _split(pieces: list[Piece]) -> tuple[str, list[dict[str, Any]]]:
    """Pieces as (all the content, the deltas)."""
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    deltas = _merged([piece for piece in pieces if not isinstance(piece, str)])
    return content, [delta for delta in deltas if not isinstance(delta, str)]


def read_answer(calling: ToolCalling, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None when it is only calls) and its calls: what a stream of
    the same text gives, put together."""
    parser = ToolCallParser(calling)
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    content += rest
    calls: list[dict[str, Any]] = []
    for delta in deltas + more:
        if delta["index"] == len(calls):
            calls.append({k: v for k, v in delta.items() if k != "index"})
        else:
            function = calls[delta["index"]]["function"]
            function["arguments"] += delta["function"]["arguments"]
    return (None if calls and not content.strip() else content), calls


def finish_reason(calling: ToolCalling, reason: str | None, num_calls: int) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (not when the request named the
    function), otherwise the engine's."""
    if num_calls and reason == "stop" and not calling.named:
        return "tool_calls"
    return reason
