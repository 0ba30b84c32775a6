"""A request in the engine's terms (`GenerateRequest`), built from a validated body by
`RequestBuilder`: the prompt tokenized (a chat through the model's template), its length checked
against the context, its options translated (router/options.py). The bodies' schemas are in
router/schemas.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from router import errors
from router.options import (
    compiled,
    logit_bias,
    request_spec,
    requested_output,
    sampling_params,
    structured_output,
)
from router.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SamplingFields,
    TokenizeRequest,
)
from router.tools import CLOSE, OPEN, ToolCalling, call_grammar, render_prompt
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Kind, StructuredOutput
from workers.model.tokenizer import Tokenizer


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
    # False (`store: false`): the registry forgets the request once it has finished; an
    # aborted one is kept for resuming.
    store: bool = True
    # The request's `cache_salt` (router/admission.py `cache_salt` turns it, and the key where
    # the key is isolated, into the engine's `SamplingParams.cache_salt`).
    cache_salt: str | None = None
    priority: int | None = None  # lower runs first; None: the API key's (router/admission.py)
    user: str | None = None  # the end user: the fair share's tenant where no API key is


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
    def refuse_unserved(body: SamplingFields) -> None:
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
        self, body: SamplingFields, structured: StructuredOutput | None
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

    def _bad_words(self, body: SamplingFields) -> tuple[tuple[int, ...], ...]:
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
        body: SamplingFields,
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
        bias = logit_bias(body, vocab)
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
            store=body.store is not False,
            cache_salt=body.cache_salt,
            priority=body.priority,
            user=body.user,
        )
