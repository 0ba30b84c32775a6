"""Sampled rows to committed tokens: the host sampler (the reference, and the CPU's) and the
device sampler (a GPU's).

`verify` (workers/engine/verification.py) decides greedy rows by their argmax and applies each
request's logit adjustments; what is left, the sampled rows' logits `[num_seqs, max_k + 1,
vocab]` with their drafts, goes to a `Sampler`, which applies the sampling transform and
rejection-samples.

- `HostSampler` brings the logits to the host and draws from each request's own
  `torch.Generator` (seeded requests) one row at a time: `kernels/rejection.py`.
- `DeviceSampler` keeps them where the forward left them and does the whole batch as tensor
  code (`kernels/rejection_device.py`), drawing from counter-based random numbers keyed by the
  request (`kernels/counter_rng.py`); only the committed token ids come to the host. A seeded
  request draws the same tokens alone or in any batch, but not the same as under the host
  sampler (another generator).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.host_copy import queued_tensor
from kernels.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from kernels.rejection_device import rejection_sample_batched
from kernels.sampling import TransformUse, logits_to_probs
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence as Sequence_
from workers.engine.sequence import same_sequences


class Sampler(ABC):
    name: str

    def device_for(self, logits: torch.Tensor) -> torch.device:
        """Where the sampled rows' logits should be gathered."""
        return logits.device

    @abstractmethod
    def sample(
        self,
        logits: torch.Tensor,  # [num_seqs, max_k + 1, vocab] fp32, on device_for(...)
        draft_ids: Sequence[Sequence[int]],  # each sequence's drafts (k may differ)
        draft_probs: Sequence[torch.Tensor | None],  # [k, vocab] q each, None: one-hot drafts
        seqs: Sequence[Sequence_],
    ) -> list[list[int]]:
        """Each sequence's committed tokens: accepted drafts, then a recovered or bonus one."""


def _per_row(values: list[float] | list[int], dtype: torch.dtype, repeat: int) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).repeat_interleave(repeat)


def _transform_rows(
    params: list[SamplingParams], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each logits row's temperature, top-k, top-p and min-p (`width` rows a sequence)."""

    def rows(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return _per_row(values, dtype, width).to(device, non_blocking=True)

    return (
        rows([p.temperature for p in params], torch.float32),
        rows([p.top_k for p in params], torch.long),
        rows([p.top_p for p in params], torch.float32),
        rows([p.min_p for p in params], torch.float32),
    )


def _transform(
    logits: torch.Tensor,  # [num_seqs, width, vocab]
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # `_transform_rows`
    uses: TransformUse | None,
) -> torch.Tensor:  # [num_seqs, width, vocab] probabilities
    return logits_to_probs(logits.view(-1, logits.shape[-1]), *rows, uses).view(logits.shape)


@dataclass(slots=True)
class _BatchRows:
    """A batch's transform parameters on its device and which parts of the transform it
    uses, kept while the batch's sequences stay the same (most decode steps): made again
    when a sequence joins or leaves, not every step."""

    seqs: list[Sequence_]  # held, so that none of them is another object at the same address
    width: int
    vocab: int
    device: torch.device
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    uses: TransformUse

    @classmethod
    def of(
        cls, seqs: Sequence[Sequence_], width: int, vocab: int, device: torch.device
    ) -> _BatchRows:
        params = [seq.params for seq in seqs]
        uses = TransformUse(
            greedy=any(p.greedy for p in params),
            top_k=any(0 < p.top_k < vocab for p in params),
            top_p=any(p.top_p < 1 for p in params),
            min_p=any(p.min_p > 0 for p in params),
        )
        rows = _transform_rows(params, width, device)
        return cls(list(seqs), width, vocab, device, rows, uses)

    def fits(self, seqs: Sequence[Sequence_], width: int, vocab: int, device: torch.device) -> bool:
        shape = (width, vocab, device) == (self.width, self.vocab, self.device)
        return shape and same_sequences(self.seqs, seqs)


class HostSampler(Sampler):
    name = "host"

    def device_for(self, logits: torch.Tensor) -> torch.device:
        return torch.device("cpu")

    def sample(
        self,
        logits: torch.Tensor,
        draft_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        seqs: Sequence[Sequence_],
    ) -> list[list[int]]:
        num_seqs, width, _ = logits.shape
        params = [seq.params for seq in seqs]
        target_probs = _transform(logits, _transform_rows(params, width, logits.device), None)
        drafts = torch.full((num_seqs, width - 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        for n, ids in enumerate(draft_ids):
            if ids:  # most rows at load draft nothing
                drafts[n, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        sampled = rejection_sample(
            drafts,
            [len(ids) for ids in draft_ids],
            [None if q is None else q.cpu() for q in draft_probs],
            target_probs,
            [p.greedy for p in params],
            [seq.generator for seq in seqs],
        )
        return _unpadded(sampled)


class DeviceSampler(Sampler):
    name = "device"

    def __init__(self) -> None:
        self._batch: _BatchRows | None = None  # the last step's

    def sample(
        self,
        logits: torch.Tensor,
        draft_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        seqs: Sequence[Sequence_],
    ) -> list[list[int]]:
        positions = [len(seq.token_ids) for seq in seqs]  # where this step's first token goes
        return _unpadded(self._sample(logits, draft_ids, draft_probs, seqs, positions))

    def sample_next(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab] fp32: each sequence's last row
        seqs: Sequence[Sequence_],
        positions: Sequence[int],  # where each sequence's token goes
    ) -> torch.Tensor:  # [num_seqs] int64, on the logits' device (nothing read back)
        """Each sequence's next token without drafts, as `sample` draws it, left on the device
        (async scheduling: workers/engine/overlap.py)."""
        num_seqs = len(seqs)
        no_drafts = [()] * num_seqs
        logits = logits.view(num_seqs, 1, -1)
        return self._sample(logits, no_drafts, [None] * num_seqs, seqs, positions)[:, 0]

    def _sample(
        self,
        logits: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
        draft_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[torch.Tensor | None],
        seqs: Sequence[Sequence_],
        positions: Sequence[int],
    ) -> torch.Tensor:  # [num_seqs, max_k + 1] int64, padded with PLACEHOLDER_TOKEN_ID
        num_seqs, width, vocab = logits.shape
        device = logits.device
        batch = self._batch
        if batch is None or not batch.fits(seqs, width, vocab, device):
            batch = self._batch = _BatchRows.of(seqs, width, vocab, device)
        target_probs = _transform(logits, batch.rows, batch.uses)
        max_k = width - 1
        # A row a sequence: its drafts (padded), how many, its random key and the position
        # this step samples from; built as lists and made a tensor once.
        pad = [PLACEHOLDER_TOKEN_ID] * max_k
        rows = [
            [*ids, *pad[len(ids) :], len(ids), seq.rng_key, position]
            for ids, seq, position in zip(draft_ids, seqs, positions, strict=True)
        ]
        host = queued_tensor(rows, torch.long, device)
        q, has_q = _stacked_probs(draft_probs, num_seqs, max_k, vocab, device)
        tokens, _ = rejection_sample_batched(
            host[:, :max_k], host[:, max_k], q, has_q, target_probs, host[:, -2], host[:, -1]
        )
        return tokens


def _unpadded(tokens: torch.Tensor) -> list[list[int]]:  # [num_seqs, max_k + 1], padded
    """Each row's committed tokens, without the PLACEHOLDER_TOKEN_ID padding (on the host)."""
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in tokens.tolist()]


def _stacked_probs(
    draft_probs: Sequence[torch.Tensor | None],
    num_seqs: int,
    max_k: int,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The drafts' q as one `[num_seqs, max_k, vocab]` tensor and which rows have one; (None,
    None) when every draft is one-hot."""
    if all(q is None for q in draft_probs):
        return None, None
    stacked = torch.zeros(num_seqs, max_k, vocab, dtype=torch.float32, device=device)
    for n, q in enumerate(draft_probs):
        if q is not None:
            stacked[n, : q.shape[0]] = q.to(device, torch.float32)
    has = torch.tensor([q is not None for q in draft_probs], device=device)
    return stacked, has
