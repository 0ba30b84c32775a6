"""Batched rejection sampling of draft tokens: the step that keeps speculation lossless.

For each sequence with k draft tokens x_1..x_k (drawn from q) the target scored k + 1 positions
(p_1..p_{k+1}). Walking left to right, draft x_j is *accepted* with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection a *recovered* token is drawn from
norm(max(0, p_j - q_j)) and the walk stops; if every draft is accepted, a *bonus* token is drawn
from p_{k+1}. The committed tokens are then distributed exactly as the target's own samples
(Leviathan et al. 2023; Chen et al. 2023).

Greedy rows (temperature 0) skip the randomness: a draft is accepted while it equals the
target's argmax, and the recovered/bonus token is the argmax. A drafter that gives no q
(n-gram lookup) proposes deterministically, which is q = one-hot on its token.

Output: `[num_seqs, max_k + 1]`, each row the committed tokens padded with PLACEHOLDER_TOKEN_ID.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.sampling import draw, draw_rows

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k] int64, padded with PLACEHOLDER_TOKEN_ID
    num_draft_tokens: list[int],  # k of each sequence (ragged)
    draft_probs: Sequence[torch.Tensor | None],  # per sequence [k, vocab] q, or None = one-hot
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab] p, after the sampling transform
    greedy: list[bool],  # temperature 0 for the sequence
    generators: list[torch.Generator | None],  # per sequence, for its seed
) -> torch.Tensor:  # [num_seqs, max_k + 1] int64
    num_seqs, max_k = draft_token_ids.shape
    if not (
        len(num_draft_tokens) == len(draft_probs) == len(greedy) == len(generators) == num_seqs
    ):
        raise ValueError("rejection_sample needs one k, q, greedy flag and generator per sequence")
    if target_probs.shape[:2] != (num_seqs, max_k + 1):
        raise ValueError(f"target_probs must be [{num_seqs}, {max_k + 1}, vocab]")
    rows: list[list[int]] = [[] for _ in range(num_seqs)]
    # Without a draft (decode without speculation) a row's one token is the bonus: those are
    # drawn together first, each from its own generator (a seeded row draws the same token in
    # any order; unseeded rows take other uniforms of the global RNG than one by one would).
    bonus = [i for i in range(num_seqs) if num_draft_tokens[i] == 0 and not greedy[i]]
    if bonus:
        index = torch.tensor(bonus)
        tokens = draw_rows(target_probs[index, 0], [generators[i] for i in bonus])
        for i, token in zip(bonus, tokens, strict=True):
            rows[i] = [token]
    for i in range(num_seqs):
        k = num_draft_tokens[i]
        if k == 0 and not greedy[i]:
            continue  # drawn above
        drafts = draft_token_ids[i, :k]
        p = target_probs[i, : k + 1]
        if greedy[i]:
            rows[i] = greedy_accept(drafts.tolist(), p.argmax(dim=-1).tolist())
        else:
            rows[i] = _random_row(drafts, draft_probs[i], p, generators[i])
    width = max_k + 1
    padded = [row + [PLACEHOLDER_TOKEN_ID] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.long).view(num_seqs, width)


def greedy_accept(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """A greedy row's committed tokens: the drafts while they equal the target's argmax, then
    the argmax where they first differ (or the bonus after the last). Needs no probabilities,
    so a greedy row never pays for the sampling transform."""
    k = len(draft_token_ids)
    if len(target_argmax) != k + 1:
        raise ValueError("greedy_accept needs the target's argmax at k + 1 positions")
    num_accepted = next((j for j in range(k) if draft_token_ids[j] != target_argmax[j]), k)
    return [*draft_token_ids[:num_accepted], target_argmax[num_accepted]]


def _random_row(
    drafts: torch.Tensor,  # [k]
    q: torch.Tensor | None,  # [k, vocab], None = one-hot on the drafts
    p: torch.Tensor,  # [k + 1, vocab]
    generator: torch.Generator | None,
) -> list[int]:
    k = drafts.shape[0]
    positions = torch.arange(k)
    p_draft = p[positions, drafts]  # [k]
    q_draft = torch.ones(k) if q is None else q[positions, drafts]
    uniform = torch.rand(k, generator=generator)
    # u < p/q, written without dividing by q (q(x) > 0 for any drafted x).
    rejected = (uniform * q_draft >= p_draft).nonzero()
    if len(rejected) == 0:
        return [*drafts.tolist(), draw(p[k], generator)]
    j = int(rejected[0])
    q_j = _one_hot(drafts[j], p.shape[-1]) if q is None else q[j]
    residual = (p[j] - q_j).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q exactly; cannot happen after a rejection in theory
        residual = p[j]
    return [*drafts[:j].tolist(), draw(residual, generator)]


def _one_hot(token: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab).scatter_(0, token.view(1), 1.0)
