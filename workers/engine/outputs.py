"""What the engine hands out and takes in, as plain data: a request's output after each step
(`RequestOutput`), a whole finished request (`Completion`), each step's report for its listeners
(`StepReport`, `RoundReport`: traces and metrics read them), and a prompt computed elsewhere
(`Prefilled`, from a prefill worker)."""

from __future__ import annotations

import difflib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workers.engine.logprobs import TokenLogprob
from workers.engine.sequence import Sequence as Sequence_
from workers.engine.sequence import SpecStats

if TYPE_CHECKING:  # the scheduler's module imports the engine's others
    from workers.engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    # New final text: made from the new tokens where the outputs are read
    # (workers/engine/output_text.py; "" without a tokenizer)
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    spec: SpecStats
    # One per new token when the request asked for log-probabilities (`params.logprobs`)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With the first token, when the request asked (`params.prompt_logprobs`): one per prompt
    # token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    # With finish reason "error": what failed in this request's own work (its grammar, say),
    # which ended it alone while the batch went on
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed)
    # Once finished, with a predicted output (`params.prediction`): how many of its tokens the
    # output holds, in order (OpenAI's accepted_prediction_tokens)
    accepted_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Continuation:
    """A request moved from another engine (its verifier failed), with the output it
    generated there. It goes on as if it had never left: those tokens are its output (counted
    against `max_tokens` and `min_tokens`, read by its grammar and its detokenizer, so a
    character or stop string across the seam comes out as in one run), its speculation
    statistics go on from `stats`, and its next token is verified with drafts as its next step
    there would have been (a seeded request draws what it would have drawn)."""

    token_ids: tuple[int, ...]
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass(slots=True)
class Prefilled:
    """A prompt computed elsewhere (a prefill worker): the K/V of its first n tokens,
    `[num_layers, 2, n, num_kv_heads, head_dim]` (every KV head of the model: a tensor-parallel
    runner keeps its own and passes the rest to its ranks), optionally those positions' hidden
    states of some layers (for a feature-reading drafter), and, when n is the whole prompt, the
    logits of its last position (`[vocab]`, fp32), from which the engine samples the first
    token without a forward of its own."""

    kv: torch.Tensor
    hidden: dict[int, torch.Tensor] | None = None
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class RoundReport:
    """One sequence's share of an engine step, for tracing."""

    request_id: str
    method: str  # the sequence's drafting method ("none" without speculation)
    prefill_tokens: int  # prompt tokens computed this step (0 for a decode/verify round)
    drafted: int
    accepted: int
    feature_bytes: int  # hidden states handed to its drafter this step


@dataclass(slots=True)
class StepReport:
    start_ns: int  # time.time_ns() at the start of the step
    draft_s: float  # drafting (the drafters' proposals)
    forward_s: float  # the target's forward and verification
    rounds: list[RoundReport]

    @property
    def verified(self) -> bool:
        """Whether the step verified: a sequence in it was decoding, not only prefilling."""
        return any(r.prefill_tokens == 0 for r in self.rounds)


@dataclass(slots=True)
class Completion:
    """A whole finished request, for `generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


def in_order(prediction: Sequence[int], output: Sequence[int]) -> int:
    """How many of the prediction's tokens appear in the output in order (the matching blocks
    of the two)."""
    matcher = difflib.SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def record_output(
    outputs: dict[str, RequestOutput],
    seq: Sequence_,
    tokens: list[int],
    logprobs: Sequence[TokenLogprob] = (),
) -> None:
    """Add what a step committed for `seq` to its output of this step in `outputs` (made on its
    first commit of the step)."""
    num_output = seq.num_output_tokens
    out = outputs.get(seq.request_id)
    if out is None:  # its first this step
        out = RequestOutput(
            seq.request_id,
            list(tokens),
            "",
            False,
            None,
            seq.num_prompt_tokens,
            num_output,
            seq.stats,
            list(logprobs),
            num_cached_tokens=seq.num_cached_tokens,
        )
        outputs[seq.request_id] = out
    else:
        out.new_token_ids += tokens
        out.logprobs += logprobs
        out.num_output_tokens = num_output
    if seq.params.prompt_logprobs is not None and tokens and num_output == len(tokens):
        out.prompt_logprobs = list(seq.prompt_logprobs)  # with the first token


# A step's start (`time.time_ns`), its drafting's seconds, and when its forward began
# (`time.perf_counter`)
StepTimes = tuple[int, float, float]


def step_report(
    seqs: Sequence[ScheduledSeq],
    results: Sequence[list[int] | None],  # each sequence's committed tokens (None: none)
    times: StepTimes,
    feature_bytes: dict[str, int],  # bytes of features sent to drafters, taken out by request
) -> StepReport:
    """What a step did, for its listeners (traces, metrics)."""
    start_ns, draft_s, drafted = times
    rounds = [
        RoundReport(
            s.seq.request_id,
            s.seq.spec_method,
            0 if s.decoding else s.num_new_tokens,
            len(s.draft.token_ids),
            len(tokens) - 1 if tokens else 0,
            feature_bytes.pop(s.seq.request_id, 0),
        )
        for s, tokens in zip(seqs, results, strict=True)
    ]
    return StepReport(start_ns, draft_s, time.perf_counter() - drafted, rounds)
