"""The inputs of a uniform decode/verify step, in persistent buffers a CUDA graph reads.

A uniform step feeds every sequence the same number of new tokens, `width` (its last token and
a draft; a shorter draft is padded at its end), for `num_seqs` sequences padded up to a captured
batch size. All of it lives in one int64 device buffer, written each step from a pinned host
buffer with one copy: token ids, positions, cache slots, context lengths and block tables
(`StepTensors` are views into it, at fixed addresses).

A draft tree's step (with `trees` on) also stages each new token's tail mask (which new tokens
it sees: kernels/attention_uniform.py) and its tree position; a chain's masks are causal.

Padding never touches a sequence's data: a padded token (after a short draft) or a padded
sequence writes its K/V into the scratch slot, which no sequence owns; its position is clamped
into the rotary table; a padded sequence's context is its `width` tokens over the first block
its table row holds (whatever an earlier step left there), read and never written. Their logits
are computed and never read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kernels.attention_uniform import causal_tail_masks
from workers.engine.model_runner import SeqForward

Buffer = TypeVar("Buffer", torch.Tensor, np.ndarray)


@dataclass(frozen=True, slots=True)
class UniformShape:
    num_seqs: int  # the batch size a graph is captured for (real sequences + padding)
    width: int  # new tokens per sequence


@dataclass(frozen=True, slots=True)
class StepTensors:
    """One shape's views into the device buffer."""

    input_ids: torch.Tensor  # [num_seqs * width] int64
    positions: torch.Tensor  # [num_seqs * width] int64
    slot_mapping: torch.Tensor  # [num_seqs * width] int64
    tail_masks: torch.Tensor  # [num_seqs, width] int64 (written only with `trees` on)
    seq_lens: torch.Tensor  # [num_seqs] int64, cached tokens + width
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64


class Staging:
    """An int64 device buffer written from a host one with one copy a step: the host buffer is
    pinned on a GPU, so the copy runs asynchronously and the host side is written again only
    once the last copy has read it (`host()` waits for that)."""

    def __init__(self, size: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self._pinned = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._host = self._pinned.numpy()
        # On the host the two are one buffer: a step's forward runs after its staging, and
        # the next staging after that forward, with nothing to copy.
        self.device = (
            self._pinned if device.type == "cpu" else torch.zeros_like(self._pinned, device=device)
        )
        self._copied = torch.cuda.Event() if pinned else None

    def host(self) -> np.ndarray:
        """The host buffer, to write, once the last copy has read it."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host

    def send(self, end: int) -> None:
        """Copy the host buffer's first `end` values to the device buffer."""
        if self.device is self._pinned:
            return
        self.device[:end].copy_(self._pinned[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class StepBuffers:
    def __init__(
        self,
        max_num_seqs: int,
        max_width: int,
        max_blocks: int,  # block table columns: the longest context's blocks (+ a padded draft)
        block_size: int,
        scratch_slot: int,
        max_positions: int,
        device: torch.device,
        trees: bool = False,
    ) -> None:
        self.max_num_seqs, self.max_width, self.max_blocks = max_num_seqs, max_width, max_blocks
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.max_positions = max_positions
        self.trees = trees
        num_tokens = max_num_seqs * max_width
        # Regions: ids, positions, slots, tail masks (num_tokens each), seq_lens, then the block
        # tables (last: a step copies only its own sequences' rows of them).
        self._tokens_at = (0, num_tokens, 2 * num_tokens, 3 * num_tokens)
        self._lens_at = 4 * num_tokens
        self._tables_at = self._lens_at + max_num_seqs
        self.staging = Staging(self._tables_at + max_num_seqs * max_blocks, device)
        # The block table version each row of the host buffer holds (0: none known): a row is
        # written again only when its sequence's table changed or another sequence took it.
        self._row_versions = [0] * max_num_seqs

    def views(self, shape: UniformShape) -> StepTensors:
        return StepTensors(*self._regions(self.staging.device, shape))

    def _regions(self, buffer: Buffer, shape: UniformShape) -> tuple[Buffer, ...]:
        """`shape`'s token ids, positions and slots (`[num_seqs * width]` each), tail masks
        (`[num_seqs, width]`), context lengths (`[num_seqs]`) and block tables (`[num_seqs,
        max_blocks]`) in `buffer`, the device's or the host's."""
        b, n = shape.num_seqs, shape.num_seqs * shape.width
        ids, pos, slots, masks = (buffer[at : at + n] for at in self._tokens_at)
        lens = buffer[self._lens_at : self._lens_at + b]
        tables = buffer[self._tables_at : self._tables_at + b * self.max_blocks]
        masks = masks.reshape(b, shape.width)
        return ids, pos, slots, masks, lens, tables.reshape(b, self.max_blocks)

    def stage(self, seqs: Sequence[SeqForward], shape: UniformShape) -> None:
        """Write the step's inputs, padded to `shape`, and copy them to the device.

        Only what the step reads is written: each sequence's new tokens, and its blocks where
        the row does not hold them already (its table's version is the row's). What an earlier
        step left past them (a block table's tail, a short draft's padding token) stays:
        attention never reads past a sequence's context, padded positions are never read back,
        and every value ever written there is a valid block or token id."""
        b, w, bs = shape.num_seqs, shape.width, self.block_size
        n = len(seqs)
        if n > b:
            raise ValueError(f"{n} sequences do not fit a uniform step of {b}")
        flat_ids, flat_pos, flat_slots, masks, lens, tables = self._regions(
            self.staging.host(), shape
        )
        ids, pos, slots = (x.reshape(b, w) for x in (flat_ids, flat_pos, flat_slots))
        starts = np.zeros(b, dtype=np.int64)
        counts = np.zeros(b, dtype=np.int64)
        starts[:n] = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        counts[:n] = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        if n and counts.max() > w:
            raise ValueError(f"a sequence brings more than the step's {w} new tokens")
        if w == 1:
            ids[:n, 0] = [s.token_ids[0] for s in seqs]
        versions = self._row_versions
        for i, seq in enumerate(seqs):
            if w > 1:
                ids[i, : len(seq.token_ids)] = seq.token_ids
            if seq.block_version == 0 or versions[i] != seq.block_version:
                tables[i, : len(seq.block_ids)] = seq.block_ids
                versions[i] = seq.block_version
        offsets = np.arange(w, dtype=np.int64)
        positions = starts[:, None] + offsets[None, :]  # [b, w]
        real = offsets[None, :] < counts[:, None]
        blocks = np.take_along_axis(tables, np.where(real, positions // bs, 0), axis=1)
        slots[:] = np.where(real, blocks * bs + positions % bs, self.scratch_slot)
        if self.trees:
            masks[:] = _causal_masks(w)
            for i, seq in enumerate(seqs):
                if seq.tree is not None:  # its nodes' depths and ancestors
                    count = len(seq.tree.positions)
                    positions[i, :count] = seq.tree.positions
                    start = seq.num_computed_tokens
                    masks[i, :count] = [
                        sum(1 << (v - start) for v in keys) for keys in seq.tree.visible
                    ]
        pos[:] = np.minimum(positions, self.max_positions - 1)
        lens[:] = starts + w
        self.staging.send(self._tables_at + b * self.max_blocks)


@functools.cache
def _causal_masks(width: int) -> np.ndarray:
    """A chain's tail masks at `width` (kernels/attention_uniform.py `causal_tail_masks`)."""
    return np.array(causal_tail_masks(width), dtype=np.int64)
