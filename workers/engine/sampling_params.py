"""Per-request decoding settings, validated where they enter."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.penalties import apply_penalties, position_counts
from kernels.sampling import logits_to_probs
from workers.engine.logprobs import MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Temperature 0 is greedy decoding."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one that appears
    # Each generated token's log-probability and this many alternatives (0: none besides it);
    # None: no log-probabilities (workers/engine/logprobs.py)
    logprobs: int | None = None
    # Penalties on tokens already seen (kernels/penalties.py), applied before temperature:
    # repetition over prompt and output (1: off), frequency and presence over the output (0: off)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def penalize(
        self,
        logits: torch.Tensor,  # [len(draft_ids) + 1, vocab]
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        draft_ids: Sequence[int] = (),
    ) -> torch.Tensor:  # [len(draft_ids) + 1, vocab] fp32 on the host
        """These settings' penalties on the logits of a verify forward's rows: row j is the
        position after the output so far and the first j drafts."""
        vocab = logits.shape[-1]
        in_prompt = torch.zeros(vocab, dtype=torch.bool)
        if self.repetition_penalty != 1.0:
            in_prompt[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
        return apply_penalties(
            logits.float().cpu(),
            position_counts(output_ids, draft_ids, vocab),
            in_prompt,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
        )

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [vocab] or [1, vocab] -> [1, vocab]
        """These settings' sampling transform of one position's logits, in fp32 on the host:
        a request draws from its own CPU generator, so its sampling is host work on any device
        (the logits of a GPU forward come over)."""
        return logits_to_probs(
            logits.float().cpu().view(1, -1),
            torch.tensor([self.temperature], dtype=torch.float32),
            torch.tensor([self.top_k], dtype=torch.long),
            torch.tensor([self.top_p], dtype=torch.float32),
            torch.tensor([self.min_p], dtype=torch.float32),
        )
