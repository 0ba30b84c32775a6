"""Rejection sampling over the whole batch as tensor code: the device sampler's math.

The same law as `kernels/rejection.py` (accepted drafts, then a recovered token from
norm(max(0, p - q)) at the first rejection, or a bonus token from p after the last draft), for
every sequence at once: no loop over rows, no transfer to the host until the caller reads the
committed tokens. Random numbers come from `kernels/counter_rng.py`, keyed per sequence, so a
seeded sequence draws the same whatever its batch. The final token of a row is drawn by an
exponential race: argmax over the vocabulary of w_v / E_v with E_v ~ Exp(1) picks v with
probability w_v / sum(w), the categorical draw without a cumulative sum.

Outputs are `[num_seqs, max_k + 1]`, each row the committed tokens padded with
PLACEHOLDER_TOKEN_ID, and the number of committed tokens per row.
"""

from __future__ import annotations

import torch

from kernels.counter_rng import VOCAB_LANE_BASE, uniform
from kernels.rejection import PLACEHOLDER_TOKEN_ID


def greedy_accept_batched(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64, padded with PLACEHOLDER_TOKEN_ID
    num_draft_tokens: torch.Tensor,  # [num_seqs] int64
    target_argmax: torch.Tensor,  # [num_seqs, max_k + 1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_seqs, max_k + 1] int64, [num_seqs] int64)
    """Drafts while they equal the target's argmax, then the argmax where they first differ
    (the bonus after the last draft)."""
    max_k = draft_token_ids.shape[1]
    valid = torch.arange(max_k, device=draft_token_ids.device) < num_draft_tokens.unsqueeze(1)
    match = (draft_token_ids == target_argmax[:, :max_k]) & valid
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    return _committed(draft_token_ids, num_accepted, target_argmax.gather(1, _col(num_accepted)))


def rejection_sample_batched(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64, padded with PLACEHOLDER_TOKEN_ID
    num_draft_tokens: torch.Tensor,  # [num_seqs] int64
    draft_probs: torch.Tensor | None,  # [num_seqs, max_k, vocab] q; None: every draft one-hot
    has_draft_probs: torch.Tensor | None,  # [num_seqs] bool: False rows are one-hot drafts
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab] p, after the sampling transform
    keys: torch.Tensor,  # [num_seqs] int64, each sequence's RNG key
    counters: torch.Tensor,  # [num_seqs] int64, the position each sequence samples from
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_seqs, max_k + 1] int64, [num_seqs] int64)
    num_seqs, max_k = draft_token_ids.shape
    if target_probs.shape[:2] != (num_seqs, max_k + 1):
        raise ValueError(f"target_probs must be [{num_seqs}, {max_k + 1}, vocab]")
    device, vocab = target_probs.device, target_probs.shape[-1]
    safe_drafts = draft_token_ids.clamp_min(0)
    if max_k:
        p_draft = target_probs[:, :max_k].gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
        q_draft = torch.ones_like(p_draft)
        if draft_probs is not None:
            q_given = draft_probs.gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
            q_draft = torch.where(_col(_rows_with_q(has_draft_probs, num_seqs, device)), q_given, 1)
        u = uniform(keys, counters, torch.arange(max_k, device=device))
        valid = torch.arange(max_k, device=device) < num_draft_tokens.unsqueeze(1)
        # u < p/q, written without dividing by q (q(x) > 0 for any drafted x).
        accept = (u * q_draft < p_draft) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(num_seqs, dtype=torch.long, device=device)
    # The last token's distribution: p where every draft held (the bonus), else the residual.
    p_last = _at(target_probs, num_accepted)  # [num_seqs, vocab]
    weights = p_last
    if max_k:
        at = num_accepted.clamp_max(max_k - 1)
        q_last = torch.zeros_like(p_last).scatter_(1, safe_drafts.gather(1, _col(at)), 1.0)
        if draft_probs is not None:
            rows = _col(_rows_with_q(has_draft_probs, num_seqs, device))
            q_last = torch.where(rows, _at(draft_probs, at), q_last)
        residual = (p_last - q_last).clamp_min(0)
        # p == q exactly cannot reject in theory; where rounding says otherwise, draw from p.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_last)
        rejected = num_accepted < num_draft_tokens
        weights = torch.where(_col(rejected), residual, p_last)
    lanes = VOCAB_LANE_BASE + torch.arange(vocab, device=device)
    exponential = -torch.log(uniform(keys, counters, lanes))
    last = (weights / exponential).argmax(dim=1, keepdim=True)
    return _committed(draft_token_ids, num_accepted, last)


def _committed(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    num_accepted: torch.Tensor,  # [num_seqs]
    last: torch.Tensor,  # [num_seqs, 1]: the recovered or bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs, max_k = draft_token_ids.shape
    width = torch.arange(max_k + 1, device=draft_token_ids.device)
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((num_seqs, 1), 0)], dim=1)
    tokens = torch.where(width < _col(num_accepted), padded, PLACEHOLDER_TOKEN_ID)
    tokens.scatter_(1, _col(num_accepted), last)
    return tokens, num_accepted + 1


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[r, index[r]] for every row r: `[rows, n, vocab]`, `[rows]` -> `[rows, vocab]`."""
    return x.gather(1, index.view(-1, 1, 1).expand(-1, 1, x.shape[2])).squeeze(1)


def _col(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(1)


def _rows_with_q(has: torch.Tensor | None, num_seqs: int, device: torch.device) -> torch.Tensor:
    return torch.ones(num_seqs, dtype=torch.bool, device=device) if has is None else has
