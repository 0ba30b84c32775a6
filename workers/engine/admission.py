"""Whether a request can ever run on an engine: what `LLMEngine.add_request` refuses, with a
ValueError that says why (the router turns it into an HTTP 400 or INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.outputs import Continuation, Prefilled
from workers.engine.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    has_tokenizer: bool,
    prefilled: Prefilled | None = None,
    continuation: Continuation | None = None,
) -> None:
    """Raise ValueError for a request no step of this engine could serve."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; the context holds {max_model_len}"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need an engine with a tokenizer")
    if params.structured is not None and not has_tokenizer:
        raise ValueError("structured output needs an engine with a tokenizer")
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    carried = () if continuation is None else tuple(continuation.token_ids)
    if carried:
        _check_continuation(carried, len(prompt_token_ids), params, max_model_len)
        if prefilled is not None:
            raise ValueError("a continued request is prefilled where it runs")
    if prefilled is not None:
        _check_prefilled(prefilled, len(prompt_token_ids))
        if params.prompt_logprobs is not None:
            raise ValueError("a prompt prefilled elsewhere has no prompt log-probabilities")


def _check_continuation(
    carried: tuple[int, ...], num_prompt_tokens: int, params: SamplingParams, max_model_len: int
) -> None:
    if len(carried) >= params.max_tokens:
        raise ValueError(
            f"a continued request's {len(carried)} tokens leave none of max_tokens "
            f"{params.max_tokens}"
        )
    if num_prompt_tokens + len(carried) >= max_model_len:
        raise ValueError(f"a continued request must leave room in the context ({max_model_len})")
    if params.prompt_logprobs is not None:
        raise ValueError("a continued request has no prompt log-probabilities")


def _check_prefilled(prefilled: Prefilled, num_prompt_tokens: int) -> None:
    n = prefilled.kv.shape[2]
    if prefilled.logits is None and not 0 < n < num_prompt_tokens:
        raise ValueError(f"a prefilled prefix must be shorter than the prompt, got {n}")
    if prefilled.logits is not None and n != num_prompt_tokens:
        raise ValueError(
            f"prefilled logits come with the whole prompt's K/V ({num_prompt_tokens}), got {n}"
        )
