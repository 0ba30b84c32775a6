"""The chat template options a request may set (vLLM's `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs`), over the bundled tokenizer without a
model; transformers' rendering is the oracle in tests/model/test_loaders.py."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import RouterError
from router.protocol import RequestBuilder
from router.schemas import ChatCompletionRequest, TokenizeRequest, validate
from workers.model.loader import load_tokenizer
from workers.model.tokenizer import Tokenizer

STARTED = [
    {"role": "user", "content": "Name a French city."},
    {"role": "assistant", "content": "A French city: "},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def builder(tokenizer: Tokenizer) -> RequestBuilder:
    return RequestBuilder(tokenizer, "smol", 4096)


def test_continuing_the_last_message_ends_the_prompt_inside_its_turn(tokenizer: Tokenizer) -> None:
    whole = tokenizer.apply_chat_template(STARTED, add_generation_prompt=False)
    assert whole.endswith("<|im_start|>assistant\nA French city: <|im_end|>\n")
    continued = tokenizer.apply_chat_template(
        STARTED, add_generation_prompt=False, continue_final_message=True
    )
    assert continued == whole.removesuffix("<|im_end|>\n")
    with pytest.raises(ValueError, match="excludes add_generation_prompt"):
        tokenizer.apply_chat_template(STARTED, continue_final_message=True)
    with pytest.raises(ValueError, match="needs a last message with text"):
        tokenizer.apply_chat_template(
            [*STARTED[:1], {"role": "assistant", "content": " "}],
            add_generation_prompt=False,
            continue_final_message=True,
        )


def test_a_template_that_trims_content_is_continued_where_the_trimmed_text_ends() -> None:
    tokenizer = load_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    continued = tokenizer.apply_chat_template(
        STARTED, add_generation_prompt=False, continue_final_message=True
    )
    assert continued == "[user] Name a French city.</s>[assistant] A French city:"
    tokenizer = load_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"  # no content
    with pytest.raises(ValueError, match="does not show the last message's text"):
        tokenizer.apply_chat_template(
            STARTED, add_generation_prompt=False, continue_final_message=True
        )


def test_template_kwargs_reach_the_template_and_cannot_replace_its_own_variables() -> None:
    tokenizer = load_tokenizer()
    tokenizer.chat_template = (
        "{% if enable_thinking %}<think>{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    ask = STARTED[:1]
    assert tokenizer.apply_chat_template(ask) == "Name a French city."
    thinking = tokenizer.apply_chat_template(ask, template_kwargs={"enable_thinking": True})
    assert thinking == "<think>Name a French city."
    replaced = tokenizer.apply_chat_template(ask, template_kwargs={"messages": []})
    assert replaced == "Name a French city."


def test_the_builder_passes_the_options_to_the_template(builder: RequestBuilder) -> None:
    tok = builder.tokenizer

    def chat(**fields: Any) -> list[int]:
        body = validate(ChatCompletionRequest, {"messages": STARTED, **fields})
        return builder.chat(body).prompt_ids

    def tokenize(**fields: Any) -> list[int]:
        return builder.tokenize(validate(TokenizeRequest, {"messages": STARTED, **fields}))

    options = {"add_generation_prompt": False, "continue_final_message": True}
    continued = tok.encode(tok.apply_chat_template(STARTED, **options))  # type: ignore[arg-type]
    assert chat(**options) == tokenize(**options) == continued
    opened = tok.encode(tok.apply_chat_template(STARTED))
    assert chat() == tokenize() == opened
    assert chat(add_generation_prompt=False) == tok.encode(
        tok.apply_chat_template(STARTED, add_generation_prompt=False)
    )
    assert chat(chat_template_kwargs={"enable_thinking": False}) == opened  # unused here


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "tool", "content": "x", "tool_call_id": "c"},
                ],
            },
            "messages.1",
        ),
        (
            {
                "continue_final_message": True,
                "add_generation_prompt": False,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": "Calling",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    },
                ],
            },
            "messages.1",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
def test_options_the_builder_refuses(builder: RequestBuilder, fields: Any, param: str) -> None:
    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(RouterError) as caught:
            body = validate(model, {"messages": STARTED, **fields})
            if isinstance(body, ChatCompletionRequest):
                builder.chat(body)
            else:
                builder.tokenize(body)
        assert (caught.value.status, caught.value.param) == (400, param), model


def test_tokenize_takes_template_options_only_with_messages(builder: RequestBuilder) -> None:
    for field, value in (("continue_final_message", True), ("chat_template_kwargs", {"a": 1})):
        with pytest.raises(RouterError) as caught:
            builder.tokenize(validate(TokenizeRequest, {"prompt": "hi", field: value}))
        assert caught.value.param == field
