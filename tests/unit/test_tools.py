"""Tool calling's pieces (router/tools.py) without a model: the parser, whole and streamed in
every split; the prompt for templates with and without tools; the grammar of forced calls over
the bundled tokenizer; and the requests the builder refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import AddedToken

from router.errors import RouterError
from router.protocol import RequestBuilder
from router.schemas import ChatCompletionRequest, CompletionRequest, validate
from router.tools import (
    CLOSE,
    ToolCalling,
    ToolCallParser,
    block_text,
    call_grammar,
    finish_reason,
    read_answer,
    render_prompt,
)
from tests.model.helpers import NAME_AND_AGE, TIME, WEATHER
from workers.engine.structured import Grammars
from workers.model.loader import load_tokenizer
from workers.model.tokenizer import Tokenizer

CALLING = ToolCalling(("get_weather", "get_time"))
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]

# Text before the calls, two calls, a block that names no known function (content), a call with
# its arguments as a string, whitespace around blocks.
ANSWER = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>\n'
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>\n'
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def streamed(
    text: str, cuts: list[int], calling: ToolCalling = CALLING
) -> tuple[str, list[dict[str, Any]], int]:
    """Content, calls (their deltas put together by index, as a client does) and calls
    counted when `text` arrives cut at `cuts`."""
    parser = ToolCallParser(calling)
    content, deltas = "", list[dict[str, Any]]()
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        part, more = parser.feed(text[start:end])
        content, deltas = content + part, deltas + more
    rest, more = parser.finish()
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas + more:
        call = calls.setdefault(delta["index"], {"id": delta.get("id"), "name": "", "args": ""})
        assert "id" in delta or call["id"] is not None  # a call opens with its id
        call["name"] += delta["function"].get("name", "")
        call["args"] += delta["function"]["arguments"]
    together = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
        for _, c in sorted(calls.items())
    ]
    return content + rest, together, parser.num_calls


def names_and_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_an_answers_calls_and_content() -> None:
    content, calls = read_answer(CALLING, ANSWER)
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    bad = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    assert content == f"Let me look.{bad}\n"  # whitespace next to a call is not content
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_streaming_gives_the_whole_answers_content_and_calls_in_every_split() -> None:
    whole_content, whole_calls = read_answer(CALLING, ANSWER)
    for cuts in [[i] for i in range(1, len(ANSWER))] + [list(range(1, len(ANSWER)))]:
        content, calls, counted = streamed(ANSWER, cuts)
        assert content == whole_content, cuts
        assert names_and_arguments(calls) == names_and_arguments(whole_calls), cuts
        assert counted == 2


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.  \n",
        "ends in a partial tag <tool",
        "a <tool_calls> lookalike and < signs <",
        "",
    ],
)
def test_text_without_calls_is_content_unchanged(text: str) -> None:
    assert read_answer(CALLING, text) == (text, [])
    for cut in range(1, len(text)):
        assert streamed(text, [cut])[:2] == (text, [])


def test_a_stream_holds_back_only_what_may_start_a_block() -> None:
    parser = ToolCallParser(CALLING)
    assert parser.feed("Sure, ") == ("Sure,", [])  # the space may come before a block
    assert parser.feed("here <tool") == (" here", [])
    assert parser.feed("box>") == (" <toolbox>", [])


@pytest.mark.parametrize(
    ("body", "is_call"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', True),
        ('{"name": "get_time"}', True),  # no arguments: an empty object
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}', False),  # not JSON
        ('{"name": "get_weather", "arguments": [1]}', False),
        ('{"name": "get_weather", "arguments": "not json"}', False),
        ('["get_weather"]', False),
        ('{"name": ["get_weather"], "arguments": {}}', False),
    ],
)
def test_what_a_block_must_hold_to_be_a_call(body: str, is_call: bool) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    content, calls = read_answer(CALLING, text)
    assert (len(calls), content) == ((1, None) if is_call else (0, text))


def test_an_unclosed_block_at_the_end_is_a_call_if_it_reads_as_one() -> None:
    """With parallel_tool_calls false the answer stops at `</tool_call>`, which is left out."""
    text = block_text("get_weather", {"city": "Rome"}).removesuffix(CLOSE)
    assert names_and_arguments(read_answer(CALLING, text)[1]) == [("get_weather", {"city": "Rome"})]
    cut_short = '<tool_call>\n{"name": "get_weather", "argu'
    assert read_answer(CALLING, cut_short) == (cut_short, [])


FORCED = ToolCalling(CALLING.names, forced=True)
# As a forced call's grammar lets the model write them: arguments over lines, strings holding
# brackets, quotes and the end tag.
FORCED_ANSWER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}]ris \\"</tool_call>\\" {[",\n'
    '  "days": [1, {"x": 2}]}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
)
FORCED_ARGUMENTS = [
    '{"city": "Pa}]ris \\"</tool_call>\\" {[",\n  "days": [1, {"x": 2}]}',
    "{}",
]


def test_a_forced_calls_arguments_stream_as_written_in_every_split() -> None:
    """Under a forced call a call opens (id, name) once its arguments begin, and they follow in
    pieces; put together, every split gives the whole answer's calls."""
    content, calls = read_answer(FORCED, FORCED_ANSWER)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == list(
        zip(("get_weather", "get_time"), FORCED_ARGUMENTS, strict=True)
    )
    assert json.loads(calls[0]["function"]["arguments"])["days"] == [1, {"x": 2}]
    for cuts in [[i] for i in range(1, len(FORCED_ANSWER))] + [list(range(1, len(FORCED_ANSWER)))]:
        content, streamed_calls, counted = streamed(FORCED_ANSWER, cuts, FORCED)
        assert content == "" and counted == 2, cuts
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls], cuts
    parser = ToolCallParser(FORCED)
    opened = parser.feed(FORCED_ANSWER[: FORCED_ANSWER.index("Pa}")])
    assert opened == (
        "",
        [
            {
                "index": 0,
                "id": opened[1][0]["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "'},
            }
        ],
    )
    assert parser.feed("Pa}") == ("", [{"index": 0, "function": {"arguments": "Pa}"}}])


def test_a_forced_call_cut_short_keeps_the_arguments_it_has() -> None:
    """max_tokens ends the answer inside the arguments: the call has what was written, as
    OpenAI's does (finish reason "length"); a block cut before its arguments is content."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = read_answer(FORCED, cut)
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Pa'
    before = '<tool_call>\n{"name": "get_weather", "argu'
    assert read_answer(FORCED, before) == (before, [])
    # Arguments that are not an object (written as a string) come whole when the block closes.
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    assert names_and_arguments(read_answer(FORCED, text)[1]) == [("get_time", {"zone": "CET"})]


def test_finish_reason() -> None:
    assert finish_reason(CALLING, "stop", 1) == "tool_calls"
    assert finish_reason(CALLING, "stop", 0) == "stop"
    assert finish_reason(CALLING, "length", 1) == "length"
    assert finish_reason(ToolCalling(("get_weather",), named=True), "stop", 1) == "stop"


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
            {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "noon"},
]


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer: Tokenizer) -> None:
    assert not tokenizer.takes_tools
    prompt = render_prompt(tokenizer, CONVERSATION, TOOLS)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions:")
    assert json.dumps(TOOLS[0]) in system and json.dumps(TOOLS[1]) in system
    calls = block_text("get_weather", {"city": "Rome"}) + "\n" + block_text("get_time", {})
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in prompt
    results = "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in prompt
    # Without tools shown (tool_choice none) the conversation's calls are still written.
    plain = render_prompt(tokenizer, CONVERSATION, None)
    assert "You can call" not in plain and calls in plain


def test_a_template_that_takes_tools_renders_them_itself() -> None:
    tokenizer = load_tokenizer()
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.arguments.city }}{% endfor %};"
        "{% endfor %}"
    )
    assert tokenizer.takes_tools
    prompt = render_prompt(tokenizer, CONVERSATION, TOOLS)
    assert prompt.startswith("TOOL get_weather;TOOL get_time;system: Be brief.;")
    assert "assistant:  CALL Rome CALL ;" in prompt  # arguments as an object
    assert "tool: sunny;tool: noon;" in prompt


def test_the_grammar_of_forced_calls(tokenizer: Tokenizer) -> None:
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)

    def accepts(grammar: Any, text: str) -> tuple[bool, bool]:
        """Whether the grammar takes all of `text`, and whether it must end there."""
        state = grammars.start(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return state.advance(ids) == len(ids), state.stopped

    weather = block_text("get_weather", {"city": "Paris"})
    time = block_text("get_time", {})
    required = call_grammar([WEATHER, TIME], None, parallel=True)
    assert accepts(required, f"{weather}\n{time}") == (True, False)
    assert not accepts(required, block_text("get_weather", {"town": "Paris"}))[0]
    assert not accepts(required, "Sure: " + weather)[0]
    assert accepts(call_grammar([WEATHER, TIME], None, parallel=False), weather) == (True, True)
    named = call_grammar([WEATHER, TIME], "get_time", parallel=True)
    assert accepts(named, time) == (True, True)
    assert not accepts(named, weather)[0]
    # A function without parameters takes any object.
    assert accepts(call_grammar([{"name": "f"}], None, True), block_text("f", {"x": [1]}))[0]
    # auto with a JSON output: calls, or JSON that follows its schema, and nothing else.
    either = call_grammar([WEATHER, TIME], None, True, answer=NAME_AND_AGE)
    assert accepts(either, f"{weather}\n{time}") == (True, False)
    assert accepts(either, '{"name": "Bob", "age": 41}') == (True, True)
    assert not accepts(either, '{"name": "Bob"}}')[0]
    assert not accepts(either, "Bob is 41.")[0]
    assert not accepts(either, '{"name": "Bob", "age": 41}' + weather)[0]


def test_tags_that_are_tokens_of_their_own() -> None:
    """Where the tokenizer has the tags as added tokens (Qwen2.5's `<tool_call>`), which
    llguidance reads as special tokens, the grammar asks for those tokens; the text keeps them,
    so the answer's call is read."""
    tokenizer = load_tokenizer()
    tags = [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", CLOSE)]
    tokenizer.backend.add_tokens(tags)
    opening = tokenizer.added_token_id("<tool_call>")
    assert opening == tokenizer.vocab_size - 2 and tokenizer.added_token_id("<tool") is None
    grammar = call_grammar([WEATHER], "get_weather", parallel=False, tokenizer=tokenizer)
    ids = tokenizer.encode(block_text("get_weather", {"city": "Oslo"}), add_special_tokens=False)
    assert ids[0] == opening and ids[-1] == opening + 1
    state = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids).start(grammar)
    assert state.allowed()[0].nonzero().flatten().tolist() == [opening]
    assert state.advance(ids) == len(ids) and state.stopped
    text = tokenizer.decode(ids)
    assert names_and_arguments(read_answer(CALLING, text)[1]) == [("get_weather", {"city": "Oslo"})]


def test_tags_that_are_special_tokens_stay_in_the_text() -> None:
    """Where the tags are special tokens (decoding leaves them out by default), a request with
    tools shows special tokens in its text, so that its calls are read."""
    tokenizer = load_tokenizer()
    tags = [AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", CLOSE)]
    tokenizer.backend.add_tokens(tags)
    ids = tokenizer.encode(block_text("get_weather", {"city": "Oslo"}), add_special_tokens=False)
    assert tokenizer.is_special(ids[0]) and not tokenizer.is_special(ids[1])
    assert read_answer(CALLING, tokenizer.decode(ids))[1] == []  # the tags left out
    builder = RequestBuilder(tokenizer, "smol", 4096)
    request = builder.chat(validate(ChatCompletionRequest, {"messages": ASK, "tools": TOOLS}))
    assert not request.params.skip_special_tokens
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert names_and_arguments(read_answer(CALLING, text)[1]) == [("get_weather", {"city": "Oslo"})]
    plain = builder.chat(validate(ChatCompletionRequest, {"messages": ASK}))
    assert plain.params.skip_special_tokens


def test_parameter_schemas_with_definitions(tokenizer: Tokenizer) -> None:
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    with_refs: dict[str, Any] = {
        "name": "visit",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "$defs": {"City": city},
        },
    }
    grammar = call_grammar([with_refs, WEATHER], None, parallel=False)
    for town, fits in (("Rome", True), ("Oslo", False)):
        state = grammars.start(grammar)
        ids = tokenizer.encode(block_text("visit", {"city": town}), add_special_tokens=False)
        assert (state.advance(ids) == len(ids)) is fits
    clash = {**with_refs, "name": "other"}
    clash["parameters"] = {**with_refs["parameters"], "$defs": {"City": {"type": "integer"}}}
    with pytest.raises(ValueError, match="define"):
        call_grammar([with_refs, clash], None, parallel=True)


@pytest.fixture(scope="module")
def builder(tokenizer: Tokenizer) -> RequestBuilder:
    return RequestBuilder(tokenizer, "smol", 4096)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_the_builder_reads_tool_choice(builder: RequestBuilder) -> None:
    def build(**fields: Any) -> Any:
        return builder.chat(validate(ChatCompletionRequest, {"messages": ASK, **fields}))

    auto = build(tools=TOOLS)
    assert auto.tools == CALLING and auto.params.structured is None and auto.params.stop == ()
    assert "You can call" in builder.tokenizer.decode(auto.prompt_ids)
    single = build(tools=TOOLS, parallel_tool_calls=False)
    assert single.params.stop == (CLOSE,)
    required = build(tools=TOOLS, tool_choice="required")
    assert required.tools == FORCED and required.params.structured is not None
    named = build(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.tools == ToolCalling(CALLING.names, named=True, forced=True)
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": NAME_AND_AGE}}
    either = build(tools=TOOLS, response_format=schema)  # auto: calls, or the schema's JSON
    assert either.tools == FORCED and either.params.structured is not None
    assert either.params.stop == ()
    regex = build(tools=TOOLS, structured_outputs={"regex": "[ab]+"})  # the regex holds it all
    assert regex.tools == CALLING and regex.params.structured is not None
    none = build(tools=TOOLS, tool_choice="none")
    assert none.tools is None and "You can call" not in builder.tokenizer.decode(none.prompt_ids)
    assert build().tools is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"functions": [WEATHER]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": CONVERSATION[2]["tool_calls"]}
                ]
            },
            "messages.0.tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(
    builder: RequestBuilder, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(RouterError) as refused:
        builder.chat(validate(ChatCompletionRequest, {"messages": ASK, **fields}))
    assert (refused.value.status, refused.value.param) == (400, param)


def test_completions_take_no_tools(builder: RequestBuilder) -> None:
    for fields, param in (({"tools": TOOLS}, "tools"), ({"tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(RouterError) as refused:
            builder.completions(validate(CompletionRequest, {"prompt": "hi", **fields}))
        assert refused.value.param == param
