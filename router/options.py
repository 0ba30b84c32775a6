"""A validated body's options in the engine's terms: sampling parameters, structured output
and speculation.

Structured output comes in OpenAI's `response_format` (`json_object`, `json_schema`) and in
vLLM's fields: `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and
the older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. A request asks
for one at most; each is compiled and checked here, so a bad schema is a 400 naming its field.
Chat's `tools` and `tool_choice` are read here too (the format itself is `router/tools.py`'s): a
forced call is a grammar like those, so it excludes them.
"""

from __future__ import annotations

from typing import Any

from router import errors
from router.schemas import SamplingFields, SpeculativeOptions
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Kind, StructuredOutput, compile_grammar


def logit_bias(body: SamplingFields, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise errors.bad_request(
                f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias"
            )
        bias.append((int(key), value))
    return tuple(bias)


def sampling_params(
    body: SamplingFields,
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


def structured_output(body: SamplingFields) -> StructuredOutput | None:
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


def requested_output(body: SamplingFields) -> tuple[str, Kind, Any] | None:
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
