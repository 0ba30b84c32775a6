"""Per-request decoding settings, validated where they enter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
