"""EAGLE's greedy draft as one fixed-shape program: what a CUDA graph captures.

A proposal for `num_seqs` greedy sequences, each drafting up to `depth` tokens, is one call of
`EagleDraftLoop.draft`: the head's extend over each sequence's new feature rows (the positions
verified since its last proposal, at most `width` = k + 1 of them, padded at the end as a
uniform verify step is), then `depth` draft steps, each the LM head over the draft vocabulary,
its argmax and that token's probability, and (but for the last) the head's layer over the
drawn token. Everything it reads lives in persistent buffers (`LoopBuffers`): the rows' next
tokens, each sequence's first cache row and row count, the block tables, and the feature rows;
the cache slots and positions of every step are computed from them on the device. Its outputs,
every sequence's `depth` tokens and probabilities, come back in one device-to-host copy; the
host cuts each draft to its sequence's k and confidence bar (base.py `ConfidenceStop`), which
decides nothing the device needed: a draft that ends early only leaves draft rows in the head's
cache, which the next proposal rolls back anyway.

On a GPU `capture` records one graph per (batch size, depth) (batch sizes 1, 2, 4, 8, then every
16, as the verifier's graph runner), so a proposal is one replay instead of tens of launches and
a host sync per token. Elsewhere the same program runs eagerly, which is how the CPU tests check
it against the eager drafter (workers/drafting/eagle.py). Padded sequences and padded rows write
their K/V to a scratch slot that no sequence owns; their outputs are never read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from workers.drafting.base import ConfidenceStop, Draft
from workers.drafting.eagle_seq import EagleSeq
from workers.eagle.head import EagleHead
from workers.engine.config import EngineConfig
from workers.engine.graph_runner import (
    CaptureReport,
    capture_graphs,
    capture_sizes,
    replay_or_run,
)
from workers.engine.step_buffers import Buffer, Staging
from workers.kv_cache import NoFreeBlocksError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The greedy draft loop (workers/drafting/eagle_loop.py): how many sequences it drafts at
    once (more go the eager way) and its deepest draft (the engine's k)."""

    max_seqs: int
    max_depth: int
    attention: AttentionBackend | None = None  # default: the uniform backend for the device
    tree_nodes: int = 0  # with draft trees: their loop too (workers/drafting/eagle_tree_loop.py)


def loop_config(config: EngineConfig, device: torch.device) -> LoopConfig | None:
    """The draft loop an engine's EAGLE drafter gets: on a GPU (unless `enforce_eager`), for as
    many sequences as may draft at once (fewer than `disable_batch_size` are unfinished) and
    the engine's k; None elsewhere, where the eager path is the faster (it attends over each
    context's own rows, the loop's torch fallback over whole block tables)."""
    k = config.spec.num_speculative_tokens
    if device.type != "cuda" or config.enforce_eager or k == 0:
        return None
    seqs = min(config.max_num_seqs, config.spec.disable_batch_size)
    return LoopConfig(seqs, k, tree_nodes=config.spec.tree_nodes)


@dataclass(frozen=True, slots=True)
class LoopShape:
    num_seqs: int  # a captured batch size (real sequences + padding)
    depth: int  # draft tokens per sequence


@dataclass(frozen=True, slots=True)
class LoopSeq:
    """One sequence's part of a proposal."""

    next_ids: list[int]  # the token after each new feature row (1..width of them)
    first_row: int  # the head-cache row of the first new feature row
    block_ids: list[int]  # its head-cache block table, covering every row the loop writes


class LoopBuffers:
    """The loop's inputs, one staged int64 buffer (step_buffers.py `Staging`): where each new
    feature row goes in the feature buffer, next tokens (both
    `[max_seqs * width]`), first rows and row counts (`[max_seqs]` each) and block tables
    (`[max_seqs, max_blocks]`); the feature rows have their own device buffer."""

    def __init__(
        self,
        max_seqs: int,
        width: int,
        max_blocks: int,
        feature_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_seqs, self.width, self.max_blocks = max_seqs, width, max_blocks
        num_rows = max_seqs * width
        self._ids_at = num_rows  # the feature rows' places come first
        self._firsts_at = 2 * num_rows
        self._counts_at = self._firsts_at + max_seqs
        self._tables_at = self._counts_at + max_seqs
        self.staging = Staging(self._tables_at + max_seqs * max_blocks, device)
        self.features = torch.zeros(num_rows, feature_width, dtype=dtype, device=device)

    def views(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(next ids `[num_seqs, width]`, first rows, row counts, block tables) on the device."""
        return self._regions(self.staging.device, num_seqs)

    def _regions(self, buf: Buffer, num_seqs: int) -> tuple[Buffer, Buffer, Buffer, Buffer]:
        b, w = num_seqs, self.width
        ids = buf[self._ids_at : self._ids_at + b * w].reshape(b, w)
        firsts = buf[self._firsts_at : self._firsts_at + b]
        counts = buf[self._counts_at : self._counts_at + b]
        tables = buf[self._tables_at : self._tables_at + b * self.max_blocks]
        return ids, firsts, counts, tables.reshape(b, self.max_blocks)

    def stage(self, seqs: list[LoopSeq], features: list[torch.Tensor], num_seqs: int) -> None:
        """Write a proposal's inputs, padded to `num_seqs` (padding has no rows), and its
        feature rows (`features[i]`: `[len(seqs[i].next_ids), feature width]`, on the device)."""
        host = self.staging.host()
        ids, firsts, counts, tables = self._regions(host, num_seqs)
        ids[:] = 0
        firsts[:] = 0
        counts[:] = 0
        tables[:] = 0
        num_rows = 0
        for i, seq in enumerate(seqs):
            n = len(seq.next_ids)
            ids[i, :n] = seq.next_ids
            firsts[i], counts[i] = seq.first_row, n
            tables[i, : len(seq.block_ids)] = seq.block_ids
            host[num_rows : num_rows + n] = range(i * self.width, i * self.width + n)
            num_rows += n
        self.staging.send(self._tables_at + num_seqs * self.max_blocks)  # the last table
        rows = features[0] if len(features) == 1 else torch.cat(features)
        self.features.index_copy_(0, self.staging.device[:num_rows], rows)


class EagleDraftLoop:
    """The fixed-shape greedy draft of an EAGLE head over its paged cache (module docstring)."""

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
        max_rows: int,  # the most head-cache rows a sequence has (its context and a draft)
        min_confidence: float = 0.0,  # the drafts' confidence bar (base.py `ConfidenceStop`)
        draft_rows: int = 0,  # rows a proposal writes past its new ones (default: a chain's)
    ) -> None:
        if max_depth < 1:
            raise ValueError("the draft loop drafts at least one token")
        self.head, self.kv_cache, self.attention = head, kv_cache, attention
        self.min_confidence = min_confidence
        self.confidence = min_confidence > 0  # whether drafts need the head's probabilities
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.sizes = capture_sizes(max_seqs)
        self.max_depth, self.width = max_depth, max_depth + 1
        self.max_positions = head.config.max_positions
        device, dtype = kv_cache[0].device, kv_cache[0].dtype
        config = head.config
        max_blocks = -(-(max_rows + self.width + (draft_rows or max_depth)) // block_size)
        self.buffers = LoopBuffers(
            self.sizes[-1],
            self.width,
            max_blocks,
            len(config.target_layers) * config.target_hidden_size,
            dtype,
            device,
        )
        b = self.sizes[-1]
        # Outputs by depth, `[max_depth, max_seqs]`: each depth writes a contiguous row.
        self._tokens = torch.zeros(max_depth, b, dtype=torch.int64, device=device)
        self._probs = torch.ones(max_depth, b, dtype=torch.float32, device=device)
        pinned = device.type == "cuda"
        self._tokens_host = torch.zeros(max_depth, b, dtype=torch.int64, pin_memory=pinned)
        self._probs_host = torch.zeros(max_depth, b, dtype=torch.float32, pin_memory=pinned)
        self._tokens_np, self._probs_np = self._tokens_host.numpy(), self._probs_host.numpy()
        self._graphs: dict[LoopShape, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.num_eager_runs = 0

    @property
    def max_seqs(self) -> int:
        return self.sizes[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def shape_for(self, num_seqs: int, depth: int) -> LoopShape:
        if not 1 <= num_seqs <= self.max_seqs or not 1 <= depth <= self.max_depth:
            raise ValueError(f"no loop shape for {num_seqs} sequences x {depth} tokens")
        return LoopShape(next(s for s in self.sizes if s >= num_seqs), depth)

    def takes(self, seq: EagleSeq, k: int) -> bool:
        """Whether the loop can draft k tokens for the (greedy) sequence: at most its depth,
        and at most its width of new feature rows (the drafter feeds a prompt's many first)."""
        new = seq.num_pending
        ready = 1 <= new <= self.width or (new == 0 and seq.last_feature is not None)
        return k <= self.max_depth and ready

    def prepare(
        self, items: list[tuple[str, EagleSeq, int]], draft_rows: int
    ) -> tuple[list[tuple[str, EagleSeq, int, torch.Tensor]], list[LoopSeq], dict[str, Draft]]:
        """Each (request id, sequence, its number) as the loop takes it: its new feature rows,
        its `LoopSeq` with cache rows for them and `draft_rows` more; an empty draft for those
        the head cache has no room for (they start over later)."""
        fed: list[tuple[str, EagleSeq, int, torch.Tensor]] = []
        seqs: list[LoopSeq] = []
        failed: dict[str, Draft] = {}
        for rid, seq, number in items:
            features = seq.new_rows()
            assert features is not None  # `takes` checked
            count = features.shape[0]
            try:
                seq.table.prepare_write(seq.cached, seq.cached + count + draft_rows)
            except NoFreeBlocksError:
                seq.reset()
                failed[rid] = Draft([])
                continue
            seqs.append(LoopSeq(seq.next_ids(count), seq.cached, list(seq.table.block_ids)))
            fed.append((rid, seq, number, features))
        return fed, seqs, failed

    def run(self, seqs: list[LoopSeq], features: list[torch.Tensor], depth: int) -> None:
        """Stage a proposal and run it (or replay its graph), its outputs left on the device."""
        if any(not 1 <= len(s.next_ids) <= self.width for s in seqs):
            raise ValueError(f"the loop takes 1..{self.width} new rows a sequence")
        shape = self.shape_for(len(seqs), depth)
        self.buffers.stage(seqs, features, shape.num_seqs)
        if replay_or_run(self._graphs, shape, self._run):
            self.num_replays += 1
        else:
            self.num_eager_runs += 1

    def propose(self, items: list[tuple[str, EagleSeq, int]]) -> dict[str, Draft]:
        """Greedy drafts of at most k tokens for these (request id, sequence, k) in one run
        (or graph replay), each cut where the head's confidence in it falls below the bar."""
        depth = max(k for _, _, k in items)
        # Its new rows, then a row for each drafted token but the last.
        fed, seqs, drafts = self.prepare(items, depth - 1)
        if not fed:
            return drafts
        tokens, probs = self.draft(seqs, [features for *_, features in fed], depth)
        for i, (rid, seq, k, features) in enumerate(fed):
            seq.fed(features)
            seq.cached = seq.rows + depth - 1
            bar = ConfidenceStop(self.min_confidence)
            draft: list[int] = []
            for token, p in zip(tokens[i][:k], probs[i][:k], strict=True):
                draft.append(token)
                bar.drew(p)  # 1.0 without a bar
                if not bar.sure:
                    break
            drafts[rid] = Draft(draft)
        return drafts

    @torch.inference_mode()
    def draft(
        self, seqs: list[LoopSeq], features: list[torch.Tensor], depth: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Every sequence's `depth` greedy draft tokens (target ids) and the head's probability
        of each (1.0 where the loop keeps no `confidence`)."""
        self.run(seqs, features, depth)
        n = len(seqs)
        # Whole depth rows (contiguous: a strided slice of pinned memory would go through a
        # pageable temporary, synchronously); the padding's columns come along unread.
        self._tokens_host[:depth].copy_(self._tokens[:depth], non_blocking=True)
        if self.confidence:
            self._probs_host[:depth].copy_(self._probs[:depth], non_blocking=True)
        if self._tokens_host.is_pinned():
            torch.cuda.current_stream().synchronize()
        tokens = self._tokens_np[:depth, :n].T.tolist()  # numpy: no torch call per read
        if not self.confidence:
            return tokens, [[1.0] * depth] * n
        return tokens, self._probs_np[:depth, :n].T.tolist()

    @property
    def shapes(self) -> list[LoopShape]:
        """Every (batch size, depth) a graph is captured for, largest first."""
        return [LoopShape(b, d) for b in reversed(self.sizes) for d in range(self.max_depth, 0, -1)]

    def stage_padding(self, shape: LoopShape) -> None:
        """Stage `shape` as all padding (what a capture runs on: it writes the scratch slot)."""
        self.buffers.stage([], [self.buffers.features[:0]], shape.num_seqs)

    def capture(self) -> CaptureReport:
        """Capture a graph for every (batch size, depth), largest first into one pool."""
        device = self.buffers.features.device
        if device.type != "cuda":
            raise RuntimeError("CUDA graphs need the head on a CUDA device")
        graphs, report = capture_graphs(self.shapes, self.stage_padding, self._run)
        self._graphs.update(graphs)
        log.info(
            "captured %d EAGLE draft graphs (batch sizes %s, depths 1..%d) in %.1f s, %.0f MiB",
            report.num_graphs,
            self.sizes,
            self.max_depth,
            report.seconds,
            report.memory_bytes / 2**20,
        )
        return report

    def _extend(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over each sequence's new feature rows: its output at the last of them
        (`[b, hidden]`), with the sequences' first rows, row counts and block tables."""
        head, w = self.head, self.width
        ids, firsts, counts, tables = self.buffers.views(b)
        device = ids.device
        # Row j of sequence i is cache row firsts[i] + j, real while j < counts[i].
        offsets = torch.arange(w, device=device)
        rows = firsts.view(-1, 1) + offsets.view(1, -1)  # [b, w]
        real = offsets.view(1, -1) < counts.view(-1, 1)
        x = head.layer_input(head.fuse_features(self.buffers.features[: b * w]), ids.reshape(-1))
        slots, positions = self._places(rows, real, tables)
        a = self._layer(x, slots.reshape(-1), positions.reshape(-1), rows[:, 0] + w, tables, w)
        last = torch.arange(b, device=device) * w + (counts - 1).clamp(min=0)
        return a.index_select(0, last), firsts, counts, tables

    def _run(self, shape: LoopShape) -> None:
        """The draft at `shape` on the persistent buffers, into the fixed outputs."""
        head, b = self.head, shape.num_seqs
        a, firsts, counts, tables = self._extend(b)
        device = a.device
        # Every later depth's row at once, `[depth - 1, b]` (each depth's own row contiguous):
        # sequence i's d-th drawn token goes into cache row firsts[i] + counts[i] + d.
        if shape.depth > 1:
            steps = torch.arange(shape.depth - 1, device=device).view(-1, 1)
            depth_rows = (firsts + counts).view(1, -1) + steps
            depth_real = (counts > 0).view(1, -1).expand_as(depth_rows)
            depth_slots, depth_positions = self._places(depth_rows, depth_real, tables, True)
            depth_lens = depth_rows + 1
        for d in range(shape.depth):
            logits = head.draft_logits(a)
            index = logits.argmax(dim=-1)
            if self.confidence:
                probs = torch.softmax(logits.float(), dim=-1)
                self._probs[d, :b] = probs.gather(1, index.view(-1, 1)).view(-1)
            token = head.draft_vocab.index_select(0, index)
            self._tokens[d, :b] = token
            if d + 1 < shape.depth:
                x = head.layer_input(a, token)
                a = self._layer(x, depth_slots[d], depth_positions[d], depth_lens[d], tables, 1)

    def _places(
        self,
        rows: torch.Tensor,  # cache row (= rotary position) of each input row
        real: torch.Tensor,  # which rows are real (the rest write the scratch slot)
        tables: torch.Tensor,  # [b, max_blocks]
        by_depth: bool = False,  # rows are [depth, b], not [b, width]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, clamped rotary position) of each row."""
        bs = self.block_size
        index = torch.where(real, rows // bs, 0)
        blocks = tables.gather(1, index.T).T if by_depth else tables.gather(1, index)
        slots = torch.where(real, blocks * bs + rows % bs, self.scratch_slot)
        return slots.contiguous(), rows.clamp(max=self.max_positions - 1).contiguous()

    def _layer(
        self,
        x: torch.Tensor,  # [b * width, hidden]
        slots: torch.Tensor,  # [b * width] each row's cache slot
        positions: torch.Tensor,  # [b * width] each row's rotary position
        seq_lens: torch.Tensor,  # [b] each sequence's rows, these included
        tables: torch.Tensor,  # [b, max_blocks]
        width: int,
        tail_masks: torch.Tensor | None = None,  # [b, width]: a tree's rows (tree loop)
        tail_len: int = 0,
    ) -> torch.Tensor:
        num_seqs = tables.shape[0]
        meta = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=seq_lens,  # unused by uniform backends
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            query_lens_host=(width,) * num_seqs,
            seq_lens_host=(width,) * num_seqs,
            tail_masks=tail_masks,
            tail_len=tail_len,
        )
        return self.head.forward_paged(x, positions, meta, self.kv_cache, self.attention)
