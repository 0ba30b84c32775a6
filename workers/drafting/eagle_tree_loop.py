"""EAGLE-2's draft trees as one fixed-shape program: what a CUDA graph captures.

The tree of workers/drafting/eagle_tree.py, drafted on the device in one run (or one graph
replay) for a batch of sequences: the head's extend over each sequence's new feature rows (as
the chain loop's, workers/drafting/eagle_loop.py), the first depth's `BRANCH` most likely
tokens, then for each further depth the `BRANCH` nodes of the last depth with the highest
reach fed to the head in one forward (each seeing the head's context and its fed ancestors:
tail masks over the tree's rows, kernels/attention_uniform.py) and their `BRANCH` most likely
children. Every node's token, log reach and parent stays in fixed output buffers, read back in
one copy; the host keeps the `nodes` of highest reach (the same choice as the eager drafter's).

Depth d's fed rows are cache rows context + (d - 2) * BRANCH .. + BRANCH - 1 (the tree's rows
after the context), at rotary position context + d - 2, as the eager drafter places them; the
next proposal rolls them back. On a GPU `capture` records a graph per (batch size, depth).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention import AttentionBackend
from kernels.attention_uniform import MAX_TREE_WIDTH
from workers.drafting.base import Draft
from workers.drafting.eagle_loop import EagleDraftLoop, LoopSeq, LoopShape
from workers.drafting.eagle_seq import EagleSeq
from workers.drafting.eagle_tree import BRANCH, tree_draft
from workers.eagle.head import EagleHead


def tree_size(depth: int) -> int:
    """Nodes a tree of `depth` holds before its cut: BRANCH, then BRANCH^2 a further depth."""
    return BRANCH + (depth - 1) * BRANCH * BRANCH


def fed_rows(depth: int) -> int:
    """Head-cache rows a tree of `depth` writes past its new feature rows."""
    return (depth - 1) * BRANCH


class EagleTreeLoop(EagleDraftLoop):
    """The fixed-shape tree draft (module docstring) over the chain loop's buffers."""

    def __init__(
        self,
        head: EagleHead,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attention: AttentionBackend,
        *,
        block_size: int,
        scratch_slot: int,
        max_seqs: int,
        max_depth: int,
        max_rows: int,
    ) -> None:
        super().__init__(
            head,
            kv_cache,
            attention,
            block_size=block_size,
            scratch_slot=scratch_slot,
            max_seqs=max_seqs,
            max_depth=max_depth,
            max_rows=max_rows,
            draft_rows=fed_rows(max_depth),
        )
        b, n, device = self.sizes[-1], tree_size(self.max_depth), self._tokens.device
        self._nodes = torch.zeros(3, b, n, dtype=torch.float64, device=device)
        pinned = device.type == "cuda"
        self._nodes_host = torch.zeros(3, b, n, dtype=torch.float64, pin_memory=pinned)

    def takes(self, seq: EagleSeq, k: int) -> bool:
        return super().takes(seq, k) and fed_rows(k) <= MAX_TREE_WIDTH  # a tail mask's bits

    def propose_trees(self, items: list[tuple[str, EagleSeq, int, int]]) -> dict[str, Draft]:
        """Trees for these (request id, sequence, depth, nodes) in one run or replay."""
        depth = max(d for _, _, d, _ in items)
        # Its new rows, then the tree's fed rows.
        fed, seqs, drafts = self.prepare([(r, s, n) for r, s, _, n in items], fed_rows(depth))
        if not fed:
            return drafts
        tokens, scores, parents = self.draft_trees(seqs, [f for *_, f in fed], depth)
        for i, (rid, seq, nodes, features) in enumerate(fed):
            seq.fed(features)
            seq.cached = seq.rows + fed_rows(depth)
            drafts[rid] = tree_draft(tokens[i], scores[i], parents[i], nodes)
        return drafts

    @torch.inference_mode()
    def draft_trees(
        self, seqs: list[LoopSeq], features: list[torch.Tensor], depth: int
    ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Every sequence's tree before its cut: each node's token, log reach and parent."""
        self.run(seqs, features, depth)
        n, size = len(seqs), tree_size(depth)
        # The whole node buffer (contiguous; a strided slice of pinned memory would go through
        # a pageable temporary, synchronously), read for the first n sequences' trees.
        self._nodes_host.copy_(self._nodes, non_blocking=True)
        host = self._nodes_host[:, :n, :size]
        if self._nodes_host.is_pinned():
            torch.cuda.current_stream().synchronize()
        values: np.ndarray = host.numpy()
        return (
            values[0].astype(np.int64).tolist(),
            values[1].tolist(),
            values[2].astype(np.int64).tolist(),
        )

    def _run(self, shape: LoopShape) -> None:
        """The tree at `shape` on the persistent buffers, into the node outputs."""
        head, b, k = self.head, shape.num_seqs, BRANCH
        source, firsts, counts, tables = self._extend(b)  # [b, hidden]: after the context
        device = source.device
        context = firsts + counts  # the tree's first row
        hidden = source.shape[-1]
        # The first depth: the BRANCH likeliest tokens after the context.
        logp = torch.log_softmax(head.draft_logits(source).float(), dim=-1)
        scores, index = logp.topk(k, dim=-1)  # [b, k]
        tokens = head.draft_vocab[index]
        self._write(0, tokens, scores, torch.full_like(tokens, -1))
        sources = source.unsqueeze(1).expand(b, k, hidden)  # each node's proposing output
        ancestors = torch.zeros_like(tokens)  # fed ancestors' tree-row bits
        level_at, start = 0, k
        for d in range(2, shape.depth + 1):
            best, chosen = scores.topk(k, dim=-1)  # the last depth's likeliest, [b, k]
            picked_tokens = tokens.gather(1, chosen)
            picked = sources.gather(1, chosen.unsqueeze(-1).expand(b, k, hidden))
            fed = torch.arange(k, device=device) + (d - 2) * k  # their tree rows
            masks = ancestors.gather(1, chosen) | (1 << fed).view(1, -1)
            x = head.layer_input(picked.reshape(b * k, hidden), picked_tokens.reshape(-1))
            fed_at = context.view(-1, 1) + fed.view(1, -1)  # [b, k] cache rows
            fed_real = (counts > 0).view(-1, 1).expand(b, k)
            fed_slots, _ = self._places(fed_at, fed_real, tables)
            at = (context + d - 2).clamp(max=self.max_positions - 1)
            a = self._layer(
                x,
                fed_slots.reshape(-1),
                at.view(-1, 1).expand(b, k).reshape(-1),
                context + (d - 1) * k,
                tables,
                k,
                masks,
                (d - 1) * k,
            )  # [b * k, hidden]
            logp = torch.log_softmax(head.draft_logits(a).float(), dim=-1)
            child_scores, child_index = logp.topk(k, dim=-1)  # [b * k, k]
            scores = (best.reshape(-1, 1) + child_scores).reshape(b, k * k)
            tokens = head.draft_vocab[child_index].reshape(b, k * k)
            parents = (level_at + chosen).repeat_interleave(k, dim=1)
            self._write(start, tokens, scores, parents)
            sources = a.reshape(b, k, hidden).repeat_interleave(k, dim=1)
            ancestors = masks.repeat_interleave(k, dim=1)
            level_at, start = start, start + k * k

    def _write(
        self, at: int, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor
    ) -> None:
        b, n = tokens.shape
        self._nodes[0, :b, at : at + n] = tokens
        self._nodes[1, :b, at : at + n] = scores
        self._nodes[2, :b, at : at + n] = parents
