"""Repetition, frequency and presence penalties on logits, as vLLM and OpenAI define them.

- repetition (transformers' and vLLM's, 1 = off): a token already in the prompt or the output
  has its logit divided by the penalty where positive, multiplied by it where negative;
- frequency (OpenAI's, 0 = off): minus the penalty times the token's count in the output;
- presence (OpenAI's, 0 = off): minus the penalty once for a token present in the output.

In a verify forward, row j of a sequence scores the position after its j-th draft token, so its
output so far ends with the first j drafts: `position_counts` builds each row's counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_counts(
    token_ids: Sequence[int], vocab: int, device: torch.device | None = None
) -> torch.Tensor:  # [vocab] fp32
    """How often each token occurs in `token_ids`."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab).float()


def position_counts(
    output_ids: Sequence[int],
    draft_ids: Sequence[int],
    vocab: int,
    device: torch.device | None = None,
) -> torch.Tensor:  # [len(draft_ids) + 1, vocab] fp32
    """Row j: how often each token occurs in `output_ids` plus the first j drafts (built on
    `device`: draft j marked in row j, then summed down the rows)."""
    counts = token_counts(output_ids, vocab, device).repeat(len(draft_ids) + 1, 1)
    if draft_ids:
        drafted = torch.zeros_like(counts)
        rows = torch.arange(1, len(draft_ids) + 1, device=device)
        drafted[rows, torch.tensor(list(draft_ids), dtype=torch.long, device=device)] = 1.0
        counts += drafted.cumsum(dim=0)
    return counts


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab]
    output_counts: torch.Tensor,  # [rows, vocab] each token's count in the output so far
    in_prompt: torch.Tensor,  # [vocab] bool: the token occurs in the prompt
    repetition: float,
    frequency: float,
    presence: float,
) -> torch.Tensor:  # [rows, vocab] fp32, a new tensor
    logits = logits.float().clone()
    if repetition != 1.0:
        seen = (output_counts > 0) | in_prompt
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    if frequency != 0.0:
        logits -= frequency * output_counts
    if presence != 0.0:
        logits -= presence * (output_counts > 0).float()
    return logits


def apply_row_penalties(
    logits: torch.Tensor,  # [..., vocab]
    output_counts: torch.Tensor,  # [..., vocab]
    in_prompt: torch.Tensor,  # bool, broadcast to the logits
    repetition: torch.Tensor,  # fp32, broadcast to the logits: 1 = off
    frequency: torch.Tensor,  # fp32, broadcast: 0 = off
    presence: torch.Tensor,  # fp32, broadcast: 0 = off
) -> torch.Tensor:  # fp32, a new tensor
    """`apply_penalties` with each row's own penalties, every one applied (one that is off is
    its neutral value, which leaves the logits exactly as they were): the same arithmetic, so
    each row comes out bit for bit as `apply_penalties` gives it alone."""
    logits = logits.float()
    seen = output_counts > 0
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen | in_prompt, penalized, logits)
    logits = logits - frequency * output_counts
    return logits - presence * seen.float()
