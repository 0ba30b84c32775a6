"""OpenAI request bodies: their schemas (which the OpenAPI document shows), their validation,
and their translation into what the engine takes.

Validation is strict about types (`"max_tokens": "5"` is refused, not coerced) and names the
offending field in the error's `param`, as OpenAI does. Unknown fields are ignored, as vLLM does,
so clients that send newer OpenAI fields keep working; but the fields that ask for what this
server does not do (the legacy `functions`, best_of, suffix) are refused, not ignored.

Structured output comes in OpenAI's `response_format` (`json_object`, `json_schema`) and in
vLLM's fields: `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and
the older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. A request asks
for one at most; each is compiled and checked here, so a bad schema is a 400 naming its field.
Chat's `tools` and `tool_choice` are read here too (the format itself is `router/tools.py`'s): a
forced call is a grammar like those, so it excludes them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router import errors
from router.tools import CLOSE, OPEN, ToolCalling, call_grammar, render_prompt
from workers.engine.config import RequestSpec
from workers.engine.logprobs import MAX_LOGPROBS
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Kind, StructuredOutput, compile_grammar
from workers.model.tokenizer import Tokenizer

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


class _SamplingFields(Strict):
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
    user: str | None = Field(None, description="an end-user id (accepted, not used)")
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


class CompletionRequest(_SamplingFields):
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


class ChatCompletionRequest(_SamplingFields):
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


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated request in the engine's terms, whichever API it came from."""

    prompt_ids: list[int]
    params: SamplingParams
    spec: RequestSpec | None
    stream: bool
    include_usage: bool
    chat: bool
    n: int = 1  # choices, each its own sequence in one verifier group
    continuous_usage: bool = False  # a stream's every chunk carries the usage so far
    tokens_as_ids: bool = False  # log-probabilities name tokens `token_id:<id>`
    echo: str | None = None  # completions' `echo`: the prompt's text, before each answer
    score_only: bool = False  # `max_tokens` 0: the prompt is scored, no answer is returned
    tools: ToolCalling | None = None  # chat: the answer's tool calls are parsed against these
    resumed_tokens: int = 0  # a resumed request: the tokens committed before (in the prompt)


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


def _logit_bias(body: _SamplingFields, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise errors.bad_request(
                f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias"
            )
        bias.append((int(key), value))
    return tuple(bias)


def sampling_params(
    body: _SamplingFields,
    max_tokens: int | None,
    default_max_tokens: int,
    logprobs: int | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> SamplingParams:
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise errors.bad_request("stop strings must be non-empty", "stop")
    top_k = body.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens or default_max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, top_k),
            min_p=body.min_p or 0.0,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop=stops,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            logit_bias=logit_bias,
            min_tokens=body.min_tokens or 0,
            prompt_logprobs=body.prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as exc:
        raise errors.bad_request(str(exc)) from exc


def structured_output(body: _SamplingFields) -> StructuredOutput | None:
    """The grammar the body asks its answer to follow, if any; 400 for a bad one, or more
    than one."""
    asked = requested_output(body)
    return None if asked is None else compiled(asked)


def compiled(asked: tuple[str, Kind, Any]) -> StructuredOutput:
    """The grammar of a `requested_output`; 400 naming its field when it does not compile."""
    param, kind_of, value = asked
    try:
        return compile_grammar(kind_of, value)
    except ValueError as exc:
        raise errors.bad_request(str(exc), param) from exc


def requested_output(body: _SamplingFields) -> tuple[str, Kind, Any] | None:
    """The structured output the body asks for, as (the field, its kind, its value), if any;
    400 for more than one."""
    asked: list[tuple[str, Kind, Any]] = []
    response_format = body.response_format or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", "json", {"type": "object"}))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise errors.bad_request(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        asked.append(("response_format", "json", schema))
    elif kind != "text":
        raise errors.bad_request(
            f"response_format {kind!r} is not supported: text, json_object or json_schema",
            "response_format",
        )
    options = body.structured_outputs
    fields: tuple[tuple[str, Kind], ...] = (
        ("json_", "json"),
        ("regex", "regex"),
        ("choice", "choice"),
        ("grammar", "grammar"),
    )
    if options is not None:
        for name, kind_of in fields:
            if getattr(options, name) is not None:
                asked.append(("structured_outputs", kind_of, getattr(options, name)))
        if options.json_object:
            asked.append(("structured_outputs", "json", {"type": "object"}))
    guided: tuple[tuple[str, Kind], ...] = (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    )
    for name, kind_of in guided:
        if getattr(body, name) is not None:
            asked.append((name, kind_of, getattr(body, name)))
    if not asked:
        return None
    if len(asked) > 1:
        raise errors.bad_request(
            "ask for one structured output at most: "
            + ", ".join(sorted({param for param, _, _ in asked})),
            asked[1][0],
        )
    return asked[0]


def request_spec(options: SpeculativeOptions | None) -> RequestSpec | None:
    if options is None:
        return None
    try:
        return RequestSpec(options.enabled, options.method, options.num_speculative_tokens)
    except ValueError as exc:
        raise errors.bad_request(str(exc), "speculative") from exc


# What the router hands every chat template itself (`chat_template_kwargs` may not set them).
_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates take it; 400 for one whose fields do not fit its role."""
    param = f"messages.{index}"
    content = message.content
    if content is not None and not isinstance(content, str):
        content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    if message.tool_calls and role != "assistant":
        raise errors.bad_request("only assistant messages hold tool_calls", f"{param}.tool_calls")
    if content is None and not message.tool_calls:
        raise errors.bad_request("content is required", f"{param}.content")
    if role == "tool" and not message.tool_call_id:
        raise errors.bad_request("a tool message needs tool_call_id", f"{param}.tool_call_id")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id or f"call_{index}_{number}",
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for number, call in enumerate(message.tool_calls)
        ]
    if role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


class RequestBuilder:
    """Turns validated bodies into `GenerateRequest`s for one served model."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise errors.not_found(f"the model {model!r} does not exist", "model")

    @staticmethod
    def refuse_unserved(body: _SamplingFields) -> None:
        """400 for a field that asks for what this server does not do."""
        if body.functions:
            raise errors.bad_request("functions (legacy) is not supported: use tools", "functions")
        if body.function_call not in (None, "none"):
            raise errors.bad_request(
                "function_call (legacy) is not supported: use tool_choice", "function_call"
            )
        if isinstance(body, CompletionRequest):
            if body.tools:
                raise errors.bad_request("tools are for chat completions", "tools")
            if body.tool_choice not in (None, "none"):
                raise errors.bad_request("tool_choice is for chat completions", "tool_choice")
        if body.best_of not in (None, 1):
            raise errors.bad_request("best_of is not supported (use n)", "best_of")
        if getattr(body, "suffix", None):
            raise errors.bad_request("suffix (insertion) is not supported", "suffix")

    def completion(self, body: CompletionRequest) -> GenerateRequest:
        """A request with one prompt (a batch is a 400: `completions` takes those)."""
        (request,) = self.completions(body, batch=False)
        return request

    def completions(self, body: CompletionRequest, batch: bool = True) -> list[GenerateRequest]:
        """One request per prompt of the body, in order."""
        self.check_model(body.model)
        self.refuse_unserved(body)
        if body.max_tokens == 0 and not body.echo:
            raise errors.bad_request("max_tokens 0 scores the prompt: it needs echo", "max_tokens")
        prompt = body.prompt
        single = isinstance(prompt, str) or not prompt or isinstance(prompt[0], int)
        prompts: list[Any] = [prompt] if single else list(prompt)
        if not single and not batch:
            raise errors.bad_request("this API takes one prompt a request", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise errors.bad_request(f"at most {MAX_PROMPTS} prompts a request", "prompt")
        structured = structured_output(body)  # compiled once for every prompt
        return [self._completion(body, p, structured) for p in prompts]

    def _completion(
        self,
        body: CompletionRequest,
        prompt: str | list[int],
        structured: StructuredOutput | None,
    ) -> GenerateRequest:
        if isinstance(prompt, str):
            if not prompt:
                raise errors.bad_request("prompt must not be empty", "prompt")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
                raise errors.bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        keep = body.truncate_prompt_tokens
        if keep is not None and len(prompt_ids) > keep:
            prompt_ids = prompt_ids[-keep:]
            prompt = prompt_ids  # an echo shows what was kept
        request = self._build(
            body,
            prompt_ids,
            body.max_tokens or (1 if body.max_tokens == 0 else None),
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            False,
            body.logprobs,
            structured,
        )
        if not body.echo:
            return request
        # The echoed prompt carries its tokens' log-probabilities when the answer's do.
        params = request.params
        if body.logprobs is not None:
            scores = max(body.logprobs, body.prompt_logprobs or 0)
            params = replace(params, prompt_logprobs=scores)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
        return replace(request, params=params, echo=text, score_only=body.max_tokens == 0)

    def chat(self, body: ChatCompletionRequest) -> GenerateRequest:
        self.check_model(body.model)
        self.refuse_unserved(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        shown, calling, grammar = self._tools(body)
        asked = requested_output(body)
        if asked is not None and grammar is not None:
            raise errors.bad_request(
                "a forced tool call and a structured output exclude each other", "tool_choice"
            )
        if asked is not None and calling is not None and asked[1] == "json":
            # auto with a JSON output: the answer is calls, or JSON that follows the schema
            grammar = self._calls_or_json(body, asked)
            calling = replace(calling, forced=True)
        elif asked is not None:
            grammar = compiled(asked)
        prompt_ids = self.tokenizer.encode(self._render(messages, shown, body))
        if body.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-body.truncate_prompt_tokens :]
        max_tokens = body.max_completion_tokens or body.max_tokens
        remaining = max(1, self.max_model_len - len(prompt_ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        request = self._build(body, prompt_ids, max_tokens, remaining, True, logprobs, grammar)
        if body.prediction is not None:
            content = body.prediction.content
            text = content if isinstance(content, str) else "".join(p.text for p in content)
            predicted = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            request = replace(request, params=replace(request.params, prediction=predicted))
        if calling is None:
            return request
        params = request.params
        if not body.parallel_tool_calls and not calling.forced:  # one call: stop where it closes
            params = replace(params, stop=(*params.stop, CLOSE))
        if any(self.tokenizer.is_special(t) for t in self._tag_tokens()):  # the parser reads them
            params = replace(params, skip_special_tokens=False)
        return replace(request, params=params, tools=calling)

    def _tag_tokens(self) -> list[int]:
        """The tool-call tags' own tokens, where the tokenizer has them."""
        ids = (self.tokenizer.added_token_id(tag) for tag in (OPEN, CLOSE))
        return [t for t in ids if t is not None]

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        """The token ids `/tokenize` answers with."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("send prompt or messages (one of them)", "prompt")
        if body.messages is None:
            for field in ("tools", "continue_final_message", "chat_template_kwargs"):
                if getattr(body, field):
                    raise errors.bad_request(f"{field} comes with messages", field)
            special = body.add_special_tokens is not False
            return self.tokenizer.encode(body.prompt or "", add_special_tokens=special)
        if not body.messages:
            raise errors.bad_request("messages must not be empty", "messages")
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None
        text = self._render(messages, tools, body)
        # The chat template writes the BOS it wants (as chat completions encode it).
        return self.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))

    def detokenize(self, body: DetokenizeRequest) -> str:
        self.check_model(body.model)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise errors.bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return self.tokenizer.decode(body.tokens)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: ChatCompletionRequest | TokenizeRequest,
    ) -> str:
        """The prompt text, with the request's chat template options."""
        if options.continue_final_message:
            if options.add_generation_prompt:
                raise errors.bad_request(
                    "continue_final_message needs add_generation_prompt: false",
                    "continue_final_message",
                )
            final = messages[-1]
            if final["role"] == "tool" or "tool_calls" in final or not final["content"].strip():
                raise errors.bad_request(
                    "continue_final_message continues a last message with text and no tool calls",
                    f"messages.{len(messages) - 1}",
                )
        kwargs = options.chat_template_kwargs or {}
        taken = sorted(set(kwargs) & _TEMPLATE_VARIABLES)
        if taken:
            raise errors.bad_request(
                f"chat_template_kwargs may not set {', '.join(taken)}: the request does",
                "chat_template_kwargs",
            )
        try:
            return render_prompt(
                self.tokenizer,
                messages,
                tools,
                options.add_generation_prompt,
                options.continue_final_message,
                kwargs,
            )
        except ValueError as exc:  # no template, or one that refuses the conversation
            raise errors.bad_request(str(exc), "messages") from exc

    def _tools(
        self, body: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, ToolCalling | None, StructuredOutput | None]:
        """The tools the prompt shows, how the answer's calls are read and the grammar of a
        forced call (required, or a named function); none of them with tool_choice none."""
        tools = body.tools or []
        names = [tool.function.name for tool in tools]
        if len(set(names)) < len(names):
            raise errors.bad_request("tool names must be unique", "tools")
        choice = body.tool_choice or ("auto" if tools else "none")
        if choice == "none":
            return None, None, None
        if not tools:
            raise errors.bad_request("tool_choice other than none needs tools", "tool_choice")
        shown = [tool.model_dump(exclude_none=True) for tool in tools]
        functions = [entry["function"] for entry in shown]
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise errors.bad_request(f"no tool named {named!r}", "tool_choice")
        if choice == "auto":
            return shown, ToolCalling(tuple(names)), None
        try:
            grammar = call_grammar(functions, named, body.parallel_tool_calls, self.tokenizer)
        except ValueError as exc:
            raise errors.bad_request(f"a tool's parameters: {exc}", "tools") from exc
        return shown, ToolCalling(tuple(names), named=named is not None, forced=True), grammar

    def _allowed(
        self, body: _SamplingFields, structured: StructuredOutput | None
    ) -> tuple[int, ...]:
        allowed = body.allowed_token_ids or []
        if allowed and structured is not None:  # the grammar may need a token it rules out
            raise errors.bad_request(
                "allowed_token_ids and a structured output (or tool call) exclude each other",
                "allowed_token_ids",
            )
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in allowed):
            raise errors.bad_request(
                f"allowed token ids must be in [0, {vocab})", "allowed_token_ids"
            )
        return tuple(sorted(set(allowed)))

    def _check_some_token_left(self, params: SamplingParams) -> None:
        """400 where `allowed_token_ids` leaves nothing to generate from the start: every
        allowed token a bad word of one token, or, with `min_tokens`, only tokens that end the
        text. (Bad words of more tokens can still close the last way on later; the engine then
        ends the answer where no token may come next, verification.py `DeadEnd`.)"""
        if not params.allowed_token_ids:
            return
        banned = {word[0] for word in params.bad_words if len(word) == 1}
        usable = set(params.allowed_token_ids) - banned
        if not usable:
            raise errors.bad_request(
                "bad_words rule out every token of allowed_token_ids", "allowed_token_ids"
            )
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        if params.min_tokens > 0 and usable <= {*params.stop_token_ids, *eos}:
            raise errors.bad_request(
                "every token of allowed_token_ids ends the text, which min_tokens holds off",
                "allowed_token_ids",
            )

    def _bad_words(self, body: _SamplingFields) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as written and after a space (as it appears mid-text), as
        vLLM takes them."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in body.bad_words or ():
            if not word.strip():
                raise errors.bad_request("bad words must not be empty", "bad_words")
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return tuple(sequences)

    def _calls_or_json(
        self, body: ChatCompletionRequest, asked: tuple[str, Kind, Any]
    ) -> StructuredOutput:
        param, _, schema = asked
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools or ()]
            return call_grammar(
                functions, None, body.parallel_tool_calls, self.tokenizer, answer=schema
            )
        except ValueError as exc:  # json.JSONDecodeError is one
            raise errors.bad_request(
                f"the structured output or a tool's parameters: {exc}", param
            ) from exc

    def _build(
        self,
        body: _SamplingFields,
        prompt_ids: list[int],
        max_tokens: int | None,
        default_max_tokens: int,
        chat: bool,
        logprobs: int | None,
        structured: StructuredOutput | None,
    ) -> GenerateRequest:
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise errors.bad_request(f"stop token ids must be in [0, {vocab})", "stop_token_ids")
        bias = _logit_bias(body, vocab)
        params = sampling_params(body, max_tokens, default_max_tokens, logprobs, bias)
        params = replace(
            params,
            allowed_token_ids=self._allowed(body, structured),
            bad_words=self._bad_words(body),
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
        self._check_some_token_left(params)
        if structured is not None:
            params = replace(params, structured=structured)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise errors.bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {len(prompt_ids)} prompt + {params.max_tokens} completion tokens",
                "messages" if chat else "prompt",
            )
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        return GenerateRequest(
            prompt_ids,
            params,
            request_spec(body.speculative),
            body.stream,
            include_usage,
            chat,
            body.n,
            continuous_usage=include_usage and bool(options and options.continuous_usage_stats),
            tokens_as_ids=body.return_tokens_as_token_ids,
        )
