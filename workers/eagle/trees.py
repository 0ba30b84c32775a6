"""Would a draft tree pay? Acceptance of static draft trees, measured offline.

A chain drafts the head's top token at each step. A tree drafts several candidates per step
(EAGLE-2, Medusa, Sequoia) and the target verifies all of them in one forward with a tree
attention mask; the longest path the target agrees with is accepted. Where drafts are
accepted, the head has been fed the target's own tokens, so along the accepted path the head's
states are exactly those of the unrolled training forward over the target's text. The greedy
acceptance of any tree therefore follows from one number per chain position: the rank of the
target's token among the head's draft logits at that step (`acceptance_ranks`).

A static tree is a set of rank paths closed under prefixes: `(0,)` is the top candidate of the
first step, `(1, 0)` the second candidate's top continuation. A chain of k drafts starting at
some position is accepted to depth d when the target's rank path of length d is in the tree, so
its mean acceptance length over all starts is 1 + the sum, over the tree's nodes, of how often
the target's path passes through the node. The best tree of n nodes is the n most travelled paths
(`best_tree`): a child is never travelled more than its parent, so they form a tree. What the
engine gets is `walk`: it steps through a sequence, each step starting where the last ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from workers.eagle.data import EagleData
from workers.eagle.head import EagleHead
from workers.eagle.unroll import make_batch, unrolled_outputs

RankPath = tuple[int, ...]
OUTSIDE = 1 << 30  # rank of a token outside the draft vocabulary: no tree holds it


@torch.no_grad()
def acceptance_ranks(
    head: EagleHead, data: EagleData, depth: int, vocab_size: int
) -> list[torch.Tensor]:
    """Per sequence, `[chains, depth]` ranks (0 = the head's top token) of the target's greedy
    token at each step of the chains that start in the answer and stay in it."""
    to_draft = torch.full((vocab_size,), -1, dtype=torch.int64)
    to_draft[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    out = []
    for seq in range(data.num_sequences):
        batch = make_batch(data, [seq], to_draft)
        outputs = unrolled_outputs(head, batch.next_tokens, batch.features, depth)
        label = batch.label_ids[0, :, 0]  # draft index of the target's top token at row i + 1
        rows = batch.answer_rows[0]
        t = label.shape[0]
        ranks = torch.full((depth, t), OUTSIDE, dtype=torch.int64)
        inside = label >= 0
        for j, a in enumerate(outputs):
            logits = head.draft_logits(a[0]).float()  # [T, draft vocab]
            own = logits.gather(-1, label.clamp(min=0)[:, None])
            ranks[j] = torch.where(inside, (logits > own).sum(-1), OUTSIDE)
        # The chain starting at row s reads row s + j at step j.
        starts = torch.tensor(
            [s for s in range(t - depth + 1) if bool(rows[s : s + depth].all())], dtype=torch.long
        )
        out.append(torch.stack([ranks[j, starts + j] for j in range(depth)], -1))
    return out


def path_counts(ranks: torch.Tensor, max_rank: int) -> Counter[RankPath]:
    """How many chains pass through each rank path (ranks beyond `max_rank` end a path)."""
    counts: Counter[RankPath] = Counter()
    for chain in ranks.tolist():
        path: list[int] = []
        for r in chain:
            if r > max_rank:
                break
            path.append(r)
            counts[tuple(path)] += 1
    return counts


def best_tree(ranks: torch.Tensor, size: int, max_rank: int = 7) -> list[RankPath]:
    """The `size` most travelled rank paths, parents before children."""
    counts = path_counts(ranks, max_rank)
    # Most travelled first; on ties a shorter path (a parent) first, then the lower ranks.
    ordered = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    tree: set[RankPath] = set()
    for path in ordered:
        if len(tree) == size:
            break
        if len(path) == 1 or path[:-1] in tree:
            tree.add(path)
    return sorted(tree, key=lambda p: (len(p), p))


def chain(k: int) -> list[RankPath]:
    return [(0,) * d for d in range(1, k + 1)]


def accepted_depth(nodes: set[RankPath], ranks: Sequence[int]) -> int:
    """How many of a chain's drafts a tree accepts: the longest rank path in it."""
    d = 0
    while d < len(ranks) and tuple(ranks[: d + 1]) in nodes:
        d += 1
    return d


def acceptance_length(tree: Iterable[RankPath], ranks: torch.Tensor) -> float:
    """Mean tokens per verify step (accepted drafts + the target's own token) over every chain,
    each start weighted alike (what training measures)."""
    nodes = set(tree)
    if len(ranks) == 0:
        return 1.0
    return 1 + sum(accepted_depth(nodes, row) for row in ranks.tolist()) / len(ranks)


def walk(tree: Iterable[RankPath], ranks: torch.Tensor) -> tuple[int, int]:
    """(tokens, verify steps) as the engine goes through one sequence: each step starts where
    the last one's accepted drafts and the target's own token ended. `ranks` are the sequence's
    chains at consecutive starts (`acceptance_ranks`).

    This is lower than `acceptance_length`: a step starts right after the head was wrong, and
    the head is more often wrong again there than at a position picked at random."""
    nodes = set(tree)
    rows = ranks.tolist()
    tokens = steps = start = 0
    while start < len(rows):
        advance = 1 + accepted_depth(nodes, rows[start])
        tokens, steps, start = tokens + advance, steps + 1, start + advance
    return tokens, steps


def level_widths(tree: Sequence[RankPath]) -> list[int]:
    """Nodes per depth: each depth is one batched head forward when drafting the tree."""
    depth = max((len(p) for p in tree), default=0)
    return [sum(1 for p in tree if len(p) == d) for d in range(1, depth + 1)]
