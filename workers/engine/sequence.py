"""One request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kernels.counter_rng import step_seed
from workers.drafting.base import EMPTY_DRAFT, Draft
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.logprobs import TokenLogprob
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarState
from workers.kv_cache import BlockTable


def _add_counts(into: list[int], counts: list[int]) -> None:
    """Add per-position counts element-wise, growing `into` as needed."""
    if len(into) < len(counts):
        into += [0] * (len(counts) - len(into))
    for i, n in enumerate(counts):
        into[i] += n


def _add_ones(into: list[int], n: int) -> None:
    """Add 1 at positions 0..n-1, growing `into` as needed."""
    if len(into) < n:
        into += [0] * (n - len(into))
    for i in range(n):
        into[i] += 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Beta prior on a sequence's acceptance rate: as if PRIOR_WEIGHT drafts at the prior's rate
# (its method's pooled rate, itself under a prior of 1/2) were already seen. Each position's
# rate is shrunk towards the one before it by as much.
PRIOR_WEIGHT = 2.0


@dataclass(slots=True)
class SpecStats:
    """Speculation counters of one request (or, summed, of an engine)."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # decode steps: each commits accepted + 1 tokens
    verify_steps_with_rejection: int = 0  # steps where a draft was rejected
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at i
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps with a draft at i
    # [i]: steps that drafted an i-th token after accepting every earlier one (what acceptance
    # at i is conditional on)
    reached_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the recovered/bonus token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.verify_steps += 1
        if not num_drafted:  # a plain decode step: nothing per position
            return
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.verify_steps_with_rejection += num_accepted < num_drafted
        _add_ones(self.accepted_per_position, num_accepted)
        _add_ones(self.drafted_per_position, num_drafted)
        _add_ones(self.reached_per_position, min(num_accepted + 1, num_drafted))

    def merge(self, other: SpecStats) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verify_steps += other.verify_steps
        self.verify_steps_with_rejection += other.verify_steps_with_rejection
        _add_counts(self.accepted_per_position, other.accepted_per_position)
        _add_counts(self.drafted_per_position, other.drafted_per_position)
        _add_counts(self.reached_per_position, other.reached_per_position)

    def copy(self) -> SpecStats:
        """The counters as they are now, apart from later steps (`merge` into empty ones, so
        a counter added to `merge` is copied too)."""
        snapshot = SpecStats()
        snapshot.merge(self)
        return snapshot

    def as_dict(self) -> dict[str, float | int]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "verify_steps": self.verify_steps,
        }


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    spec_method: str  # "none" or a drafter's method
    max_spec_tokens: int
    block_table: BlockTable
    generator: torch.Generator | None
    arrival: int
    token_ids: list[int] = field(default_factory=list)  # prompt + committed output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was admitted
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    draft: Draft = EMPTY_DRAFT  # proposed for the coming step
    stats: SpecStats = field(default_factory=SpecStats)
    eos_token_ids: frozenset[int] = frozenset()  # the model's (what `min_tokens` holds off)
    # Prompt tokens 1.. as their positions are scored, when `params.prompt_logprobs` asks
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: GrammarState | None = None  # its place in `params.structured`'s grammar
    # The device sampler's random numbers are keyed by this (kernels/counter_rng.py): from the
    # seed when the request has one, else drawn at random
    rng_key: int = 0
    share: Share = DEFAULT_SHARE  # its tenant, weight and priority (fair_share.py)
    # The tokens that end its answer: its stop tokens, and the model's EOS unless ignored
    end_token_ids: frozenset[int] = field(init=False)
    # `params.adjusts_logits`, worked out once: verification asks every step
    adjusts_logits: bool = field(init=False)
    # How long `token_ids` may grow: the prompt and `max_tokens` (the engine caps it at its
    # context), worked out once: every commit checks it
    token_limit: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.end_token_ids = self.params.end_token_ids(self.eos_token_ids)
        self.adjusts_logits = self.params.adjusts_logits
        self.token_limit = len(self.prompt_token_ids) + self.params.max_tokens

    def reseed(self) -> None:
        """Restart a seeded request's generator for this step's draws (its drafts' and its
        verification's), from its seed and the position it samples at."""
        if self.generator is not None and self.params.seed is not None:
            self.generator.manual_seed(step_seed(self.params.seed, len(self.token_ids)))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy: `num_output_tokens` where only the count is wanted."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """What the next forward may take: every uncomputed token, except that a sequence
        with output to recompute (preempted, or continued from another engine) leaves its last
        token for a decode step, which verifies drafts with it as its step would have."""
        n = self.num_uncomputed_tokens
        return n - 1 if n > 1 and len(self.token_ids) > self.num_prompt_tokens else n

    @property
    def is_decoding(self) -> bool:
        """Past the prompt, with every token but the last in the cache: the next forward
        feeds that token (and any draft) and commits new tokens."""
        n = len(self.token_ids)
        return n - self.num_computed_tokens == 1 and n > len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's positions still need scoring (`params.prompt_logprobs`)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )


def acceptance_curve(stats: SpecStats, prior: float, length: int) -> list[float]:
    """[i]: the probability that draft token i + 1 is accepted along with every one before it
    (c_1 ... c_(i+1), see the module docstring), for i < length, from a sequence's `stats` under
    a prior acceptance rate."""
    accepted, rejected = stats.accepted, stats.verify_steps_with_rejection
    rate = (accepted + PRIOR_WEIGHT * prior) / (accepted + rejected + PRIOR_WEIGHT)
    reach, survive = [], 1.0
    for i in range(length):
        hits = stats.accepted_per_position[i] if i < len(stats.accepted_per_position) else 0
        tries = stats.reached_per_position[i] if i < len(stats.reached_per_position) else 0
        rate = (hits + PRIOR_WEIGHT * rate) / (tries + PRIOR_WEIGHT)
        survive *= rate
        reach.append(survive)
    return reach


def same_sequences(kept: Seq[Sequence], seqs: Seq[Sequence]) -> bool:
    """Whether `seqs` are the very sequence objects `kept` holds, in its order (what a step's
    per-batch state made for `kept` is still good for). `kept` must hold its sequences (not
    copies of their ids), so that none of them is another object at the same address."""
    return len(seqs) == len(kept) and all(a is b for a, b in zip(seqs, kept, strict=True))
