"""Engine and speculation settings: server defaults that requests may override."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SPEC_METHODS = ("none", "ngram", "suffix", "draft_model", "eagle")
# A drafter a user brings: a `Drafter` subclass named by its import path (workers/drafting/
# user.py), as `package.module:Class`.
USER_METHOD = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
METHODS_HELP = f"one of {', '.join(SPEC_METHODS)}, or a drafter class as package.module:Class"


def is_user_method(method: str) -> bool:
    """Whether `method` names a user's drafter class (`package.module:Class`)."""
    return USER_METHOD.fullmatch(method) is not None


def valid_method(method: str) -> bool:
    return method in SPEC_METHODS or is_user_method(method)


# Where a model drafter's probability of its draft so far falls below this, the draft ends
# (workers/drafting/base.py ConfidenceStop). Measured in docs/benchmarks.md with adaptive k:
# Qwen2.5-Coder-0.5B drafting for the 1.5B gained on chat and summaries (1.16x -> 1.29x and
# 1.31x -> 1.54x vs none) and was even on code edits; the EAGLE head broke even.
DEFAULT_MIN_DRAFT_CONFIDENCE = 0.5


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Server-wide speculation defaults."""

    method: str = "none"  # one of SPEC_METHODS, or a user's drafter (`package.module:Class`)
    num_speculative_tokens: int = 4  # k, the most drafts a sequence gets per step
    ngram_min: int = 2
    ngram_max: int = 4
    # ngram and suffix drafting: where no suffix of ngram_min..ngram_max tokens occurred
    # before, the last token alone proposes at most this many tokens (0: no fallback).
    ngram_fallback_tokens: int = 8
    adaptive: bool = True  # choose k per request from its measured acceptance
    # EAGLE drafts by prompt lookup (ngram_min..ngram_max) where the text repeats, and with its
    # head elsewhere.
    eagle_prompt_lookup: bool = True
    # A model drafter (draft_model, eagle) ends a draft once its own probability of the draft
    # so far falls below this (workers/drafting/base.py ConfidenceStop); 0: always k tokens.
    min_draft_confidence: float = DEFAULT_MIN_DRAFT_CONFIDENCE
    # Cost of a forward over n = 1, 2, 3, ... new tokens (entry n - 1) in one-token forwards:
    # one sequence verifying k drafts is n = k + 1, a batch's step the sum over its sequences.
    # Beyond the last entry, in proportion. None: the engine measures it at start-up
    # (workers/engine/calibration.py).
    verify_costs: tuple[float, ...] | None = None
    # Verification stops being nearly free once the batch is this large: speculate no more.
    disable_batch_size: int = 8
    # Draft trees of at most this many nodes where the drafter drafts them (EAGLE), each cut
    # to what pays at the measured verify costs (workers/engine/speculator.py); 0: chains.
    tree_nodes: int = 0

    def __post_init__(self) -> None:
        if not valid_method(self.method):
            raise ValueError(f"spec method must be {METHODS_HELP}, got {self.method!r}")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 0..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 0 <= self.tree_nodes <= 64:
            raise ValueError(f"tree_nodes must be in 0..64, got {self.tree_nodes}")
        if self.ngram_fallback_tokens < 0:
            raise ValueError("ngram_fallback_tokens must be >= 0")
        if not 0.0 <= self.min_draft_confidence < 1.0:
            raise ValueError(
                f"min_draft_confidence must be in [0, 1), got {self.min_draft_confidence}"
            )
        if self.verify_costs is not None and (
            not self.verify_costs or any(c <= 0 for c in self.verify_costs)
        ):
            raise ValueError("verify_costs must be a non-empty tuple of positive costs")
        if self.disable_batch_size < 1:
            raise ValueError("disable_batch_size must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request's own speculation settings; None fields take the server default."""

    enabled: bool = True
    method: str | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and not valid_method(self.method):
            raise ValueError(f"speculative method must be {METHODS_HELP}, got {self.method!r}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 0..16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int = 4096
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: enough for max_num_seqs sequences of max_model_len / 4
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per step: prefill chunks + decode + draft tokens
    enable_prefix_caching: bool = True
    # On a GPU, uniform decode/verify steps replay CUDA graphs captured at start-up
    # (workers/engine/graph_runner.py); True runs every forward eagerly.
    enforce_eager: bool = False
    # On a GPU, every forward through kernels whose rows do not depend on the batch, the step
    # or the prefill chunk (kernels/batch_invariant.py, attention_invariant.py): a request's
    # greedy and seeded text then depends on the request alone. Our CPU kernels are so always.
    deterministic: bool = False
    # Launch the next plain decode step before reading this one's tokens, so that the host's
    # work overlaps the device's forward (workers/engine/overlap.py says which steps).
    async_scheduling: bool = False
    # While several tenants have requests, the most of a step's places (max_num_seqs) one
    # tenant of mean weight may fill, scaled by its weight (workers/engine/fair_share.py); 1:
    # no cap, and no prefill steps of their own for arrivals.
    max_step_share: float = 0.5
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_kv_blocks < 0:
            raise ValueError("num_kv_blocks must be >= 0")
        if not 0 < self.max_step_share <= 1:
            raise ValueError(f"max_step_share must be in (0, 1], got {self.max_step_share}")
        if self.max_num_batched_tokens < 1 + self.spec.num_speculative_tokens:
            raise ValueError("max_num_batched_tokens must fit one token plus k drafts")

    @property
    def kv_blocks(self) -> int:
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_seq = -(-max(self.max_model_len // 4, self.block_size) // self.block_size)
        return max(per_seq * self.max_num_seqs, -(-self.max_model_len // self.block_size) + 1)
