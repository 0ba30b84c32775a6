"""Repetition, frequency and presence penalties for a whole step at once.

The engine's penalized sequences each own a row of two tensors: their output's token counts
and a mask of their prompt's tokens. A step brings every row up to date with the tokens its
sequence committed since the last one (one scatter for the batch), gathers the rows of the
sequences it verifies, adds each draft to the rows after it (row j of a sequence scores the
position after its first j drafts), and applies the three penalties to all of those rows in a
handful of tensor operations: where the logits are, a GPU's included, and without a launch
per sequence. Each row's result is bit for bit what `SamplingParams.adjust` gives that
sequence alone (a penalty that is off is applied as its neutral value: x / 1, x * 1 and
x - 0 are x exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.penalties import apply_row_penalties
from workers.engine.sequence import Sequence as Sequence_
from workers.engine.sequence import same_sequences


@dataclass(slots=True)
class _Batch:
    """A step's penalized sequences, their rows and penalties on the device, kept while the
    next steps bring the same sequences (most decode steps): made again when one joins or
    leaves, not every step."""

    seqs: list[Sequence_]  # held, so that none of them is another object at the same address
    rows: list[int]
    index: torch.Tensor  # the rows, on the device
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # repetition, frequency, presence

    def fits(self, seqs: Sequence[Sequence_]) -> bool:
        return same_sequences(self.seqs, seqs)


class PenaltyRows:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self._counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self._in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._rows: dict[str, int] = {}  # request id -> its row
        self._counted: list[int] = []  # per row: the output tokens its counts hold
        self._free: list[int] = []
        self._batch: _Batch | None = None  # the last step's

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._rows)

    def apply(
        self,
        logits: torch.Tensor,  # [num_seqs, width, vocab], row j after the first j drafts
        seqs: Sequence[Sequence_],
        drafts: Sequence[Sequence[int]],  # each sequence's drafts (k + 1 <= width)
    ) -> torch.Tensor:  # [num_seqs, width, vocab] fp32, a new tensor
        """The sequences' penalties on their rows (rows past a sequence's k + 1, padding,
        are penalized as its last)."""
        width = logits.shape[1]
        batch = self._batch
        if batch is None or not batch.fits(seqs):
            batch = self._batch = self._batch_of(seqs)
        rows, index = batch.rows, batch.index
        self._catch_up(seqs, rows)
        counts = self._counts.index_select(0, index).unsqueeze(1).repeat(1, width, 1)
        # Draft t counts in every row after it: rows t + 1 .. width - 1.
        marks = [
            (n, j, token)
            for n, ids in enumerate(drafts)
            for t, token in enumerate(ids)
            for j in range(t + 1, width)
        ]
        if marks:
            where = torch.tensor(marks, device=self.device).T
            ones = torch.ones(where.shape[1], device=self.device)
            counts.index_put_((where[0], where[1], where[2]), ones, accumulate=True)
        in_prompt = self._in_prompt.index_select(0, index).unsqueeze(1)
        penalized = apply_row_penalties(logits.to(self.device), counts, in_prompt, *batch.penalties)
        return penalized.to(logits.device)

    def _batch_of(self, seqs: Sequence[Sequence_]) -> _Batch:
        """The sequences' rows (taken for those without one) and penalties, on the device."""
        rows = [self._row(seq) for seq in seqs]

        def per_seq(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device).view(-1, 1, 1)

        params = [seq.params for seq in seqs]
        penalties = (
            per_seq([p.repetition_penalty for p in params]),
            per_seq([p.frequency_penalty for p in params]),
            per_seq([p.presence_penalty for p in params]),
        )
        return _Batch(list(seqs), rows, torch.tensor(rows, device=self.device), penalties)

    def release(self, request_id: str) -> None:
        """A finished sequence's row goes back to the free ones (no-op without one)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            self._batch = None  # it held the row

    def _row(self, seq: Sequence_) -> int:
        row = self._rows.get(seq.request_id)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[seq.request_id] = row
        self._counts[row] = 0.0
        self._counted[row] = 0
        self._in_prompt[row] = False
        prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=self.device)
        self._in_prompt[row, prompt] = True
        return row

    def _grow(self) -> None:
        old = self._counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab, dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old] = self._counts
        in_prompt[:old] = self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._counted += [0] * (new - old)
        self._free += range(new - 1, old - 1, -1)  # the lowest row is taken first

    def _catch_up(self, seqs: Sequence[Sequence_], rows: list[int]) -> None:
        """Count each sequence's output tokens committed since its row was last brought up to
        date (all of them again should its output be shorter than what was counted)."""
        marks: list[int] = []
        tokens: list[int] = []
        for seq, row in zip(seqs, rows, strict=True):
            num_output, counted = seq.num_output_tokens, self._counted[row]
            if num_output == counted:
                continue
            if num_output < counted:
                self._counts[row] = 0.0
                counted = 0
            new = seq.token_ids[len(seq.token_ids) - num_output + counted :]
            marks += [row] * len(new)
            tokens += new
            self._counted[row] = num_output
        if tokens:
            where = torch.tensor([marks, tokens], dtype=torch.long, device=self.device)
            ones = torch.ones(len(tokens), device=self.device)
            self._counts.index_put_((where[0], where[1]), ones, accumulate=True)
