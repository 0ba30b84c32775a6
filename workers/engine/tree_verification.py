"""Verifying a draft tree: the longest path the target accepts, its tokens, and its K/V moved
to where a chain's would be.

A tree step's forward has one row for the last committed token (the root, row 0) and one for
each draft node (node i in row i + 1); a node's parent comes before it (`Draft.parents`). From
the root the target's token at each row decides which child, if any, is followed:

- greedy: the row's argmax; the child holding it is accepted and its row decides next, and
  where no child holds it the argmax is the step's last token (at a leaf, the bonus token);
- sampled: a tree's candidates are deterministic (the drafter's most likely tokens), so each
  child's draft distribution is one-hot on its token and rejection sampling against several
  candidates in turn stays exact: child x is accepted with probability r(x), where r starts as
  the row's target distribution p; once x is rejected r loses x (r(x) = 0, renormalized) and
  the next child is tried; with every child rejected the token is drawn from what r has left.
  For one child that is P(x) = p(x) and, after a rejection, (1 - p(x)) p(y) / (1 - p(x)) =
  p(y) for every other y: the output is distributed as p, whatever the candidates (SpecInfer's
  multi-candidate rejection for one-hot drafts; tests/unit/test_tree_verification.py checks
  it by chi-square).

The accepted nodes' K/V were written in their tree rows; `settle` moves them to the rows right
after the root, where the next step's attention and the prefix cache expect them. A request
whose settings adjust logits (penalties, a bias, a grammar, `min_tokens`) is never drafted a
tree (the speculator's rule): its rows would need each path's own adjustment.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.sampling_params import SamplingParams
from workers.kv_cache import PagedKVCache


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Per row (0 = the root), the rows of its children, in the draft's order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node + 1)
    return children


def accept_greedy(
    token_ids: Sequence[int], parents: Sequence[int], best: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(committed tokens, the rows they were decided at: the root's first) given each row's
    argmax `best`."""
    children = children_of(parents)
    row, tokens, path = 0, [], [0]
    while True:
        token = best[row]
        tokens.append(token)
        row = next((c for c in children[row] if token_ids[c - 1] == token), -1)
        if row < 0:
            return tokens, path
        path.append(row)


def accept_sampled(
    token_ids: Sequence[int],
    parents: Sequence[int],
    probs: torch.Tensor,  # [rows, vocab] fp32: each row's target distribution
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """(committed tokens, the rows they were drawn at) by multi-candidate rejection sampling
    (the module docstring)."""
    children = children_of(parents)
    row, tokens, path = 0, [], [0]
    while True:
        residual = probs[row].clone()
        follow = -1
        for child in children[row]:
            token = token_ids[child - 1]
            mass = float(residual.sum())
            chance = float(residual[token]) / mass if mass > 0 else 0.0
            if float(torch.rand((), generator=generator)) < chance:
                follow = child
                break
            residual[token] = 0.0
        if follow < 0:
            if float(residual.sum()) <= 0:  # rounding left nothing: the row's own draw
                residual = probs[row]
            tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            return tokens, path
        tokens.append(token_ids[follow - 1])
        row = follow
        path.append(row)


def verify_tree(
    token_ids: Sequence[int],
    parents: Sequence[int],
    params: SamplingParams,
    rows: torch.Tensor,  # [1 + nodes, vocab]: the root's and every node's logits
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """The committed tokens of a tree step and the rows they came from."""
    if params.greedy:
        return accept_greedy(token_ids, parents, rows.argmax(dim=-1).tolist())
    probs = torch.cat([params.probs(row) for row in rows])
    return accept_sampled(token_ids, parents, probs, generator)


def settle(
    cache: PagedKVCache, block_ids: Sequence[int], num_computed: int, path: Sequence[int]
) -> None:
    """Move the accepted nodes' K/V (tree rows `path[1:]` after the root at `num_computed`) to
    the rows right after the root, in every layer (all are read before any is written)."""
    moves = [(num_computed + r, num_computed + j) for j, r in enumerate(path) if r != j]
    if not moves:
        return
    block_size = cache.block_size

    def slots(logical: list[int]) -> torch.Tensor:
        return torch.tensor(
            [block_ids[p // block_size] * block_size + p % block_size for p in logical],
            device=cache.data.device,
        )

    layers, _, num_blocks, _, heads, dim = cache.data.shape
    flat = cache.data.view(layers, 2, num_blocks * block_size, heads, dim)
    flat[:, :, slots([d for _, d in moves])] = flat[:, :, slots([s for s, _ in moves])]
