"""OpenAI request bodies: their schemas (which the OpenAPI document shows) and their validation.

Validation is strict about types (`"max_tokens": "5"` is refused, not coerced) and names the
offending field in the error's `param`, as OpenAI does. Unknown fields are ignored, as vLLM does,
so clients that send newer OpenAI fields keep working; but the fields that ask for what this
server does not do (the legacy `functions`, best_of, suffix) are refused, not ignored. What a
valid body asks of the engine is read in router/options.py; router/protocol.py builds the
request.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router import errors
from workers.engine.fair_share import MAX_PRIORITY, MIN_PRIORITY
from workers.engine.logprobs import MAX_LOGPROBS

MAX_BODY_BYTES = 4 << 20  # JSON bodies beyond this are refused before parsing (413)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # `n`: each choice is a sequence in the verifier, and counts against admission
MAX_PROMPTS = 64  # prompts of one completions request (a batch, as evaluation harnesses send)
M = TypeVar("M", bound=BaseModel)
# A field's name in an error's location, as opposed to a union member's (`str`, `list[int]`).
_FIELD = re.compile(r"(?!(str|int|float|bool|dict|list|none)$)[a-z][a-z0-9_]*")


class Strict(BaseModel):
    """A request body's model: types are checked strictly, unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculativeOptions(Strict):
    """Outrider's extension: this request's speculation, over the server's default."""

    model_config = ConfigDict(strict=True, extra="forbid")
    enabled: bool = Field(True, description="false: no speculation for this request")
    method: str | None = Field(
        None, description="ngram, suffix, draft_model or eagle (those the deployment has)"
    )
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=16, description="most draft tokens per step (adaptive k may use fewer)"
    )


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a last chunk with empty choices and usage")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk carries the usage so far"
    )


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one of these."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema the answer follows"
    )
    regex: str | None = Field(None, description="a regular expression the whole answer matches")
    choice: list[str] | None = Field(None, description="the answer is one of these strings")
    grammar: str | None = Field(None, description="a grammar in (llguidance's) Lark syntax")
    json_object: bool | None = Field(None, description="true: any JSON object")


class SamplingFields(Strict):
    model: str | None = Field(None, description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling mass; default 1")
    top_k: int | None = Field(None, ge=-1, description="keep the k likeliest; -1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p x top")
    seed: int | None = Field(None, description="seeded sampling, independent of the batch")
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="minus this for each token already in the output"
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="minus this times the token's count in the output"
    )
    repetition_penalty: float | None = Field(
        None, gt=0, description="vLLM's extension: tokens seen in prompt or output, 1 is off"
    )
    stop: str | Annotated[list[str], Field(max_length=16)] | None = Field(
        None, description="the text ends before the first of these that appears"
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> -100..100 added to its logit"
    )
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM's extension: no EOS, stop token or stop string before"
    )
    allowed_token_ids: Annotated[list[int], Field(min_length=1)] | None = Field(
        None, description="vLLM's extension: only these tokens may be generated"
    )
    bad_words: Annotated[list[str], Field(max_length=64)] | None = Field(
        None, description="vLLM's extension: words the output never holds"
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's extension: the stop string (or token) that ends it stays"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="vLLM's extension: each prompt token's log-probability and the N likeliest",
    )
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = Field(
        None, description="vLLM's extension: the text ends at any of these tokens"
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: independent answers")
    stream: bool = Field(False, description="server-sent events")
    stream_options: StreamOptions | None = Field(None, description="with stream: usage chunk")
    return_tokens_as_token_ids: bool = Field(
        False, description="vLLM's extension: log-probabilities name tokens `token_id:<id>`"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's extension: keep only the prompt's last N tokens"
    )
    ignore_eos: bool = Field(False, description="keep generating past EOS (vLLM's extension)")
    skip_special_tokens: bool = Field(
        True, description="vLLM's extension: false shows special tokens in the text (not EOS)"
    )
    speculative: SpeculativeOptions | None = Field(
        None, description="Outrider's extension: per-request speculation"
    )
    user: str | None = Field(
        None, description="an end-user id: the tenant fair share goes by where no API key is"
    )
    priority: int | None = Field(
        None,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="vLLM's extension: lower runs first (an urgent request may preempt others); "
        "default the API key's, never more urgent than its best_priority",
    )
    store: bool | None = Field(
        None, description="false: the request registry forgets the request once it finishes"
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="vLLM's: requests share prefix-cache blocks only with the same salt",
    )
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema (structured output)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension: structured output"
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM's older extension: a JSON schema"
    )
    guided_regex: str | None = Field(None, description="vLLM's older extension: a regex")
    guided_choice: list[str] | None = Field(
        None, description="vLLM's older extension: one of these strings"
    )
    guided_grammar: str | None = Field(None, description="vLLM's older extension: a Lark grammar")
    # Asked for, not served: refused unless they ask for nothing (`_refuse_unserved`).
    functions: list[Any] | None = Field(None, description="not served (use tools): must be empty")
    function_call: str | dict[str, Any] | None = Field(
        None, description='not served (use tool_choice): only "none"'
    )
    best_of: int | None = Field(None, description="only 1")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids, or a batch of up to 64 of either (a choice per prompt)"
    )
    max_tokens: int | None = Field(
        None, ge=0, description="most tokens to generate; 0 (with echo): score the prompt only"
    )
    echo: bool = Field(
        False, description="the prompt before the answer (with logprobs: its tokens' too)"
    )
    suffix: str | None = Field(None, description="not served: must be empty")
    tools: list[Any] | None = Field(None, description="chat only: must be empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description='chat only: only "none"')
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each token's log-probability and those of the N likeliest at its position",
    )


class TextPart(Strict):
    type: Literal["text"] = Field(description="only text parts are served")
    text: str = Field(description="the part's text")


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the function's name")
    description: str | None = Field(None, description="what it does, shown to the model")
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema of its arguments (an object); none: any object"
    )
    strict: bool | None = Field(
        None, description="accepted; forced calls always follow the schema, auto ones may not"
    )


class Tool(Strict):
    type: Literal["function"] = Field(description="only functions")
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(description="one of the tools' names")


class NamedToolChoice(Strict):
    type: Literal["function"] = Field(description="only functions")
    function: FunctionName


class CalledFunction(Strict):
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments, as JSON text")


class MessageToolCall(Strict):
    id: str | None = Field(None, description="the call's id, which its result names")
    type: Literal["function"] = Field("function", description="only functions")
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="developer counts as system; tool: a tool call's result"
    )
    content: str | list[TextPart] | None = Field(
        None, description="text, or text parts joined; none only for an assistant's tool calls"
    )
    name: str | None = Field(None, description="accepted, not used")
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="an assistant message's tool calls"
    )
    tool_call_id: str | None = Field(None, description="a tool message's call id")


class PredictedOutput(Strict):
    type: Literal["content"] = Field(description="only content")
    content: str | list[TextPart] = Field(description="the text the answer is expected to be")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="OpenAI's newer name for max_tokens (wins over it)"
    )
    logprobs: bool = Field(False, description="each output token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with logprobs: the N likeliest per position"
    )
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function"
    )
    parallel_tool_calls: bool = Field(True, description="false: one tool call at most in an answer")
    add_generation_prompt: bool = Field(
        True, description="vLLM's: end the prompt with the assistant's turn opening"
    )
    continue_final_message: bool = Field(
        False,
        description="vLLM's: the answer continues the last message (add_generation_prompt false)",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: further variables for the chat template"
    )
    prediction: PredictedOutput | None = Field(
        None, description="OpenAI's predicted output: drafts copy from it (speculation only)"
    )


class TokenizeRequest(Strict):
    """vLLM's `/tokenize`: a prompt's token ids, or a conversation's through the chat template
    (with the tools it would show)."""

    model: str | None = Field(None, description="the served model's id")
    prompt: str | None = Field(None, description="text, as /v1/completions takes it")
    messages: list[ChatMessage] | None = Field(
        None, description="a conversation, as /v1/chat/completions takes it"
    )
    tools: list[Tool] | None = Field(None, description="with messages: tools the prompt shows")
    add_generation_prompt: bool = Field(
        True, description="with messages: end with the assistant's turn opening"
    )
    continue_final_message: bool = Field(
        False, description="with messages: end where the last message's text does"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="with messages: further variables for the chat template"
    )
    add_special_tokens: bool | None = Field(
        None, description="the tokenizer's BOS (default: with prompt yes, with messages no)"
    )
    return_token_strs: bool = Field(False, description="each token's text too")


class DetokenizeRequest(Strict):
    model: str | None = Field(None, description="the served model's id")
    tokens: list[int] = Field(description="token ids")


def parse_json(raw: bytes) -> Any:
    """The body as JSON: 413 when too large, 400 when not UTF-8 or not JSON."""
    if len(raw) > MAX_BODY_BYTES:
        raise errors.too_large(f"request body over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise errors.bad_request(f"body is not valid UTF-8: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise errors.bad_request(f"body is not valid JSON: {exc}") from exc


def validate(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise errors.bad_request("body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = []
        for part in first["loc"]:
            if isinstance(part, str) and not _FIELD.fullmatch(part):
                break  # the member of a union that was tried (`str`, `NamedToolChoice`, ...)
            path.append(str(part))
        param = ".".join(path) or None
        raise errors.bad_request(f"{param}: {first['msg']}", param) from exc
