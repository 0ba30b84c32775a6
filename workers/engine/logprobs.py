"""Log-probabilities of generated tokens, as OpenAI's `logprobs` and vLLM report them.

They are the target model's own distribution at each position: the log-softmax of its logits,
before temperature, top-k/top-p/min-p or any penalty (vLLM's default, `raw_logprobs`). So they
say how likely the model found each token, whatever the request sampled with, and they do not
depend on speculation: a committed token's logits come from the verify forward that scored it,
the same logits a forward without drafts gives that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (vLLM's default cap)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), likeliest first
    rank: int = 1  # 1 + how many tokens the model found likelier


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Row i of `logits` (`[n, vocab]`, any dtype or device) is the distribution `token_ids[i]`
    was drawn from; `num_top` alternatives per token (0: none). One transfer to the host."""
    n = len(token_ids)
    if n == 0:
        return []
    logp = torch.log_softmax(logits[:n].float(), dim=-1)
    ids = torch.tensor(token_ids, device=logp.device).view(n, 1)
    chosen = logp.gather(1, ids)
    ranks = ((logp > chosen).sum(dim=-1) + 1).cpu().tolist()
    values = chosen.view(n).cpu().tolist()
    if num_top == 0:
        return [
            TokenLogprob(t, lp, rank=r) for t, lp, r in zip(token_ids, values, ranks, strict=True)
        ]
    top = logp.topk(num_top, dim=-1)
    top_values, top_ids = top.values.cpu().tolist(), top.indices.cpu().tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)), r)
        for t, lp, i, v, r in zip(token_ids, values, top_ids, top_values, ranks, strict=True)
    ]
