"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities.

Completions (`"logprobs": N`) answer in the legacy shape, `{tokens, token_logprobs,
top_logprobs, text_offset}`, where each position's `top_logprobs` maps the N likeliest tokens'
texts, and the chosen token's, to their log-probabilities (as vLLM does). Chat (`"logprobs":
true, "top_logprobs": N`) answers `{"content": [{token, logprob, bytes, top_logprobs}]}` with
exactly the N likeliest. A token's text is its own decoding, which for a token holding part of a
UTF-8 character is U+FFFD; `bytes` (chat) carries its true bytes. With vLLM's
`return_tokens_as_token_ids` each token is written `token_id:<id>` instead (its `bytes` stay its
own, and completions' `text_offset` still counts the text).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from workers.engine.logprobs import TokenLogprob
from workers.model.tokenizer import Tokenizer

FLOOR = -9999.0  # what a log-probability of -inf is reported as (JSON has no infinities)


class LogprobFormatter:
    """Formats log-probabilities for one served tokenizer; each token's text and bytes are
    worked out once (a vocabulary's worth at most)."""

    def __init__(self, tokenizer: Tokenizer, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.decoded: Callable[[int], str] = functools.cache(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        # How a token is named in the answer: its text, or `token_id:<id>`.
        self.text = _token_id if tokens_as_ids else self.decoded
        self._bytes: Callable[[int], list[int]] = functools.cache(
            lambda token_id: list(tokenizer.token_bytes(token_id))
        )

    def completion(
        self, logprobs: Sequence[TokenLogprob], offset: int, first_token: int | None = None
    ) -> tuple[dict[str, Any], int]:
        """The legacy object for these tokens, whose text starts `offset` characters into the
        choice's text, and the offset where the next token's text starts (a stream's next
        chunk carries on from there). `first_token`: an echoed prompt's first token, which
        nothing before it scores (its log-probability and alternatives are null)."""
        ids = [lp.token_id for lp in logprobs]
        values: list[float | None] = [_finite(lp.logprob) for lp in logprobs]
        top: list[dict[str, float] | None] = []
        for lp in logprobs:
            alternatives = {self.text(i): _finite(v) for i, v in lp.top}
            alternatives.setdefault(self.text(lp.token_id), _finite(lp.logprob))
            top.append(alternatives)
        if first_token is not None:
            ids, values, top = [first_token, *ids], [None, *values], [None, *top]
        tokens = [self.text(token_id) for token_id in ids]
        offsets = []
        for token_id in ids:
            offsets.append(offset)
            offset += len(self.decoded(token_id))
        body = {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": top,
            "text_offset": offsets,
        }
        return body, offset

    def prompt(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then for each token a map
        from token id (a string) to its log-probability, rank and text, for the token and the
        likeliest others."""
        entries: list[dict[str, Any] | None] = [None]
        for lp in logprobs:
            entry = {
                str(i): {"logprob": _finite(v), "rank": rank, "decoded_token": self.text(i)}
                for rank, (i, v) in enumerate(lp.top, start=1)
            }
            entry[str(lp.token_id)] = {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": self.text(lp.token_id),
            }
            entries.append(entry)
        return entries

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(i, v) for i, v in lp.top],
                }
                for lp in logprobs
            ]
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.text(token_id),
            "logprob": _finite(logprob),
            "bytes": self._bytes(token_id),
        }


def _token_id(token_id: int) -> str:
    return f"token_id:{token_id}"


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)
