"""EAGLE-2's dynamic draft trees, drafted with the EAGLE head.

Where a chain drafts the head's most likely token at each depth, a tree keeps several
candidates: the first depth's `BRANCH` most likely tokens, then at each further depth the
`BRANCH` nodes of the last depth with the highest reach (the product of the head's
probabilities along the node's path) are fed to the head, each in one row of a batched forward
that sees the head's context and the node's ancestors (kernels/tree_attention.py), and each
grows its `BRANCH` most likely children. Of every node made, the `nodes` of highest reach are
the draft, most likely first (a child never reaches further than its parent, and ties keep the
parent first, so they form a tree). The verifier keeps the longest path it agrees with
(workers/engine/tree_verification.py); the reach is what the speculator prices the nodes by.

Nodes are deterministic (the head's top tokens, whatever the request's temperature): a sampled
request's tree is verified by multi-candidate rejection sampling, which stays exact for one-hot
candidates. A tree's draft rows go into the head's cache after its feature rows, as a chain's
do, and are rolled back by the next proposal alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels.attention import AttentionBackend
from kernels.tree_attention import TreeShape
from workers.drafting.base import Draft
from workers.drafting.eagle_seq import EagleSeq
from workers.eagle.head import EagleHead
from workers.engine.model_runner import SeqForward, build_inputs
from workers.kv_cache import NoFreeBlocksError, PagedKVCache

BRANCH = 4  # children per expanded node, and nodes expanded per depth


@dataclass(slots=True)
class _Node:
    token: int  # target id
    parent: int  # index in the tree's nodes, -1 for the last committed token
    score: float  # log reach
    depth: int
    source: torch.Tensor  # the head output whose logits proposed it ([hidden])
    row: int = -1  # its head-cache row once fed
    ancestors: tuple[int, ...] = ()  # head-cache rows of its fed ancestors and itself


@dataclass(slots=True)
class _Tree:
    rid: str
    seq: EagleSeq
    depth: int  # deepest node allowed
    size: int  # nodes in the draft
    context: int = 0  # the head's feature rows, which every node sees
    nodes: list[_Node] = field(default_factory=list)
    layer: tuple[int, int] = (0, 0)  # the last depth's nodes

    def draft(self) -> Draft:
        nodes = self.nodes
        return tree_draft(
            [n.token for n in nodes], [n.score for n in nodes], [n.parent for n in nodes], self.size
        )


def tree_draft(
    tokens: Sequence[int], scores: Sequence[float], parents: Sequence[int], size: int
) -> Draft:
    """The `size` nodes of highest reach (log reach `scores`) of a drafted tree, most likely
    first (ties: the earlier made, so a parent before its child), parents re-indexed."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:size]
    index = {old: new for new, old in enumerate(order)}
    return Draft(
        [tokens[i] for i in order],
        parents=tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in order),
        reach=tuple(math.exp(scores[i]) for i in order),
    )


class TreeDrafter:
    """Drafts trees for an EAGLE drafter's sequences over its head and head cache."""

    def __init__(
        self,
        head: EagleHead,
        cache: PagedKVCache,
        backend: AttentionBackend,
        vocab: torch.Tensor,  # draft index -> target id
        max_rows: int,
    ) -> None:
        self.head, self.cache, self.backend = head, cache, backend
        self.vocab, self.max_rows = vocab, max_rows
        self.drafted = 0  # trees proposed

    @torch.inference_mode()
    def propose(self, requests: Sequence[tuple[str, EagleSeq, int, int]]) -> dict[str, Draft]:
        """Trees for (request id, sequence, deepest depth, nodes) of sequences that can draft
        (an empty draft where the head cache ran out)."""
        trees: list[_Tree] = []
        inputs: list[torch.Tensor] = []
        for rid, seq, depth, size in requests:
            features = seq.new_rows()
            if features is None:
                continue
            inputs.append(self.feature_rows(seq, features))
            seq.fed(features)
            trees.append(_Tree(rid, seq, depth, size))
        drafts = {rid: Draft([]) for rid, _, _, _ in requests}
        if not trees:
            return drafts
        try:
            a = self.forward([(t.seq, x, None) for t, x in zip(trees, inputs, strict=True)])
        except NoFreeBlocksError:  # out of head cache: these sequences start over later
            for t in trees:
                t.seq.reset()
            return drafts
        for t, source in zip(trees, a, strict=True):
            t.context = t.seq.cached
            self._grow(t, [(-1, 0.0, 0, source)])
        for depth in range(2, max(t.depth for t in trees) + 1):
            growing = [t for t in trees if t.depth >= depth]
            try:
                self._expand(growing)
            except NoFreeBlocksError:
                break  # propose what was drafted; its rows are rolled back next time anyway
        for t in trees:
            drafts[t.rid] = t.draft()
        self.drafted += len(trees)
        return drafts

    def _grow(self, tree: _Tree, parents: list[tuple[int, float, int, torch.Tensor]]) -> None:
        """Each (node index, its log reach, its depth, its head output) gets its `BRANCH` most
        likely children; they become the tree's last depth."""
        sources = torch.stack([p[3] for p in parents])
        logp = torch.log_softmax(self.head.draft_logits(sources).float(), dim=-1)
        top = logp.topk(BRANCH, dim=-1)
        start = len(tree.nodes)
        for (parent, score, depth, source), values, indices in zip(
            parents, top.values.tolist(), top.indices.tolist(), strict=True
        ):
            for value, index in zip(values, indices, strict=True):
                token = int(self.vocab[index])
                tree.nodes.append(_Node(token, parent, score + value, depth + 1, source))
        tree.layer = (start, len(tree.nodes))

    def _expand(self, trees: list[_Tree]) -> None:
        """One depth: each tree's most likely nodes of its last depth fed to the head together,
        and their children grown."""
        batch: list[tuple[EagleSeq, torch.Tensor, TreeShape | None]] = []
        fed: list[list[int]] = []
        for t in trees:
            start, end = t.layer
            chosen = sorted(range(start, end), key=lambda i: (-t.nodes[i].score, i))[:BRANCH]
            first = t.seq.cached
            for n, i in enumerate(chosen):
                node = t.nodes[i]
                node.row = first + n
                above = t.nodes[node.parent].ancestors if node.parent >= 0 else ()
                node.ancestors = (*above, node.row)
            picked = [t.nodes[i] for i in chosen]
            x = self.head.layer_input(
                torch.stack([node.source for node in picked]),
                torch.tensor([node.token for node in picked], device=picked[0].source.device),
            )
            shape = TreeShape(
                t.context,
                tuple(t.context + node.depth - 1 for node in picked),
                tuple(node.ancestors for node in picked),
            )
            batch.append((t.seq, x, shape))
            fed.append(chosen)
        a = self.forward(batch, all_rows=True)
        offset = 0
        for t, chosen in zip(trees, fed, strict=True):
            parents = [
                (i, t.nodes[i].score, t.nodes[i].depth, a[offset + n]) for n, i in enumerate(chosen)
            ]
            offset += len(chosen)
            self._grow(t, parents)

    def feature_rows(self, seq: EagleSeq, features: torch.Tensor) -> torch.Tensor:
        """The head's input rows for target features that follow the sequence's feature rows
        in its cache: each fused with the token after its position."""
        next_ids = torch.tensor(seq.next_ids(features.shape[0]), device=features.device)
        return self.head.layer_input(self.head.fuse_features(features), next_ids)

    def catch_up(self, seqs: list[EagleSeq]) -> bool:
        """Feed every pending feature row of these sequences but the last into the head's
        cache in one forward (a draft loop takes a few new rows a sequence); False, with each
        sequence started over, where the head cache ran out."""
        batch: list[tuple[EagleSeq, torch.Tensor, TreeShape | None]] = []
        rows: list[torch.Tensor] = []
        for seq in seqs:
            features = seq.new_rows()
            assert features is not None  # it has pending rows
            batch.append((seq, self.feature_rows(seq, features[:-1]), None))
            rows.append(features)
        try:
            self.forward(batch)
        except NoFreeBlocksError:
            for seq in seqs:
                seq.reset()
            return False
        for seq, features in zip(seqs, rows, strict=True):
            seq.fed(features[:-1])
            seq.pending = [features[-1:]]
        return True

    def forward(
        self,
        batch: list[tuple[EagleSeq, torch.Tensor, TreeShape | None]],
        all_rows: bool = False,
    ) -> torch.Tensor:
        """Head outputs over each sequence's new rows (`x`, written after its cached rows; a
        tree's with its shape): every new row's (`all_rows`) or each sequence's last."""
        forwards = []
        for seq, x, shape in batch:
            n = x.shape[0]
            seq.table.prepare_write(seq.cached, seq.cached + n)
            forwards.append(
                SeqForward([0] * n, seq.cached, seq.table.block_ids, n if all_rows else 1, 0, shape)
            )
        inputs = build_inputs(
            forwards, self.cache.block_size, self.max_rows + 1, self.cache.data.device
        )
        for seq, x, _ in batch:
            seq.cached += x.shape[0]
        a = self.head.forward_paged(
            torch.cat([x for _, x, _ in batch]),
            inputs.positions,
            inputs.meta,
            self.cache.layers[0],
            self.backend,
        )
        return a.index_select(0, inputs.logits_indices)
