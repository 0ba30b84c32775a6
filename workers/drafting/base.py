"""The boundary between drafting and verifying.

A drafter follows each sequence it is given: it sees the prompt (`add`), then after every
verification the tokens that were committed (`commit`), and on request proposes up to k draft
tokens with their probabilities q (`propose`). It keeps its own state (an index, a KV cache) and
rolls it back to the committed prefix itself, so the verifier never tells it what was rejected.
A drafter that reads the target's features (EAGLE) names the target layers it wants in
`hidden_layers`; it is then sent those layers' hidden states for every position the verifier
has computed and kept (`observe_hidden`, before the `commit` of the tokens they produced).
Everything crossing this boundary is plain data (ids, token lists, one tensor of q per draft,
feature rows), so the drafter can live in another process or on another machine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kernels.counter_rng import step_seed
from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed tokens for one sequence; `probs` is q (`[len(token_ids), vocab]`), or None when
    the drafter chose deterministically (q is one-hot on its token).

    A draft tree (`parents` set) holds candidate continuations: node i's parent is node
    parents[i] (-1: the last committed token), parents before children, and the target keeps
    the longest path it agrees with (workers/engine/tree_verification.py). Its nodes are
    deterministic (no q), ordered by `reach`, the drafter's probability that the target
    accepts the node and its ancestors, most likely first; so any first n nodes are a tree."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None
    reach: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError("a draft needs one row of q per drafted token")
        if self.parents is not None:
            if self.probs is not None or len(self.parents) != len(self.token_ids):
                raise ValueError("a draft tree needs one parent per node, and no q")
            if any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a draft tree's parents must come before their children")

    @property
    def depth(self) -> int:
        """Tokens on the longest path (a chain's length)."""
        if self.parents is None:
            return len(self.token_ids)
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 + (depths[p] if p >= 0 else 0))
        return max(depths, default=0)

    def truncated(self, k: int) -> Draft:
        if k >= len(self.token_ids):
            return self
        if self.parents is not None:
            reach = None if self.reach is None else self.reach[:k]
            return Draft(self.token_ids[:k], None, self.parents[:k], reach)
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k])


EMPTY_DRAFT = Draft([])


@dataclass(frozen=True, slots=True)
class DraftRequest:
    request_id: str
    num_tokens: int  # committed tokens the drafter should have seen (a consistency check)
    k: int  # propose at most this many (a tree: at most this deep)
    tree_nodes: int = 0  # a drafter that `drafts_trees` may answer with a tree this large


class Drafter(ABC):
    """One drafting method serving many sequences."""

    method: str
    hidden_layers: tuple[int, ...] = ()  # target layers whose outputs this drafter reads
    drafts_trees = False  # whether it answers a request for `tree_nodes` with a draft tree

    @abstractmethod
    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Start following a sequence."""

    @abstractmethod
    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens the verifier committed for the sequence since the last call, in order."""

    def observe_hidden(  # noqa: B027 (optional: most drafters read no features)
        self, request_id: str, first_position: int, hidden: torch.Tensor
    ) -> None:
        """Target features for positions `first_position ..` of the sequence, one row each: the
        outputs of `hidden_layers`, concatenated in that order. Rows the drafter already has
        (a prefix recomputed after preemption) may come again."""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """Drafts for these sequences (any may come back shorter than k, or empty)."""

    @abstractmethod
    def remove(self, request_id: str) -> None:
        """Stop following a sequence and free what it held."""

    # Seconds one more sequence adds to a drafting forward at a depth, where the drafter has
    # measured it (`token_seconds` of EAGLE's); None: as much as the first sequence's, so a draft
    # is priced per token (workers/engine/speculator.py `step_cost`).
    row_seconds: float | None = None
    # Seconds a drafting call costs whatever its depth, where the drafter has measured it (its
    # draft loop's staging, graph launch and read-back): priced once a step for the method.
    launch_seconds: float | None = None
    # Seconds of one draft tree's proposal for one sequence, where a drafter that `drafts_trees`
    # has measured it (workers/engine/tree_pricing.py prices a tree by it).
    tree_seconds: float | None = None

    def drafts_for_free(self, request_id: str) -> bool:
        """Whether the sequence's next draft costs the drafter no forward (an EAGLE drafter's
        prompt lookup, say): the speculator then prices it as an n-gram draft, not at the
        drafter's measured cost. False unless a drafter knows better."""
        return False

    # Drafting ahead (optional): a drafter in its own process calls `draft_ahead` after it has
    # answered a proposal, while the verifier checks it. The drafter guesses the outcome (its
    # whole draft accepted, then its own choice of the bonus token) and drafts the proposal that
    # would come next. When the commit equals the guess, the next `propose` serves that draft at
    # once; otherwise it is discarded. Drafts stay drafts, so the output never depends on this.
    # When the next step arrives, `stop` (checked between forwards) ends the work where the
    # commit may still be the guess (`ahead_may_hold`), so that the forward under way adds its
    # token to the draft; where it cannot be, `abandon` gives the forward up between two layers
    # of a draft model. A wrong guess then delays the next proposal by half a layer, a right one
    # by half a forward, and a right one saves the k forwards of drafting it: drafting ahead
    # pays while a proposal is accepted whole more often than about 1 / (2k + 1) of the time.
    # Each sequence keeps a running rate of whole acceptance (`AheadState.whole_rate`) and is
    # drafted ahead for while it is at least `MIN_WHOLE_RATE` (workers/drafting/ahead.py).
    #
    # A drafter that `keeps_drafting_ahead` can also go on across proposals: called with
    # `keep_going`, `draft_ahead` extends one chain of draft tokens per sequence until stopped,
    # and a step whose commits are all the guesses is answered by `take_ahead` from the chain
    # without stopping it, once the chain holds the whole draft an in-line proposal would make
    # (usually drafted already). The step never waits for drafting it does not use, and the
    # drafter's core never idles between proposals.
    drafts_ahead: bool = False
    keeps_drafting_ahead: bool = False
    ahead_prepared: int = 0  # proposals drafted ahead so far
    ahead_served: int = 0  # of those, served because the guess was right

    def draft_ahead(  # noqa: B027
        self,
        requests: Sequence[DraftRequest],
        stop: Callable[[], bool] = lambda: False,
        abandon: Callable[[], bool] = lambda: False,
        keep_going: bool = False,
    ) -> None:
        """Prepare the next proposal of each sequence just drafted for (`requests`: the same
        requests `propose` got), unless `stop()` turns true first (the forward under way
        finishes) or `abandon()` does (it is given up where the drafter can). With
        `keep_going` (drafters that `keeps_drafting_ahead`) it returns only then."""

    def ahead_may_hold(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Whether committing `token_ids` (the next commit of the sequence) may be the guess
        its drafting ahead works on; False lets that work be abandoned."""
        return False

    def take_ahead(
        self,
        commits: Mapping[str, Sequence[int]],
        requests: Sequence[DraftRequest],
        timeout: float,
    ) -> dict[str, Draft] | None:
        """While `draft_ahead(keep_going=True)` runs on another thread: commit `commits` (one
        per sequence, nothing else happened to any) and serve `requests` from the chains, if
        every commit is its sequence's guess, waiting at most `timeout` for the chains to hold
        the drafts an in-line `propose` would make (what they hold then is served). None, with
        nothing changed, when it cannot: the caller stops drafting ahead, commits and proposes
        as usual."""
        return None

    def wake_ahead(self) -> None:  # noqa: B027
        """Wake drafting ahead that waits for a proposal to be taken (its `stop` just turned
        true)."""


@dataclass(slots=True)
class ConfidenceStop:
    """Ends a model drafter's draft where the drafter itself doubts it: once the draft's
    probability under the drafter (the product of its drawn tokens' probabilities) falls below
    `min_confidence`. The token that crosses the bar stays in the draft. A drafter's confidence
    tracks how often the target agrees (docs/benchmarks.md), so this keeps long drafts where
    they will be accepted and saves verifying tails that will not. The length is decided from
    the drafts before the target sees them, so speculation stays lossless; 0 never stops."""

    min_confidence: float
    probability: float = 1.0

    @property
    def sure(self) -> bool:
        """Whether the draft so far is probable enough to draft another token after it."""
        return self.probability >= self.min_confidence

    def drew(self, token_probability: float) -> None:
        self.probability *= token_probability


def greedy_probability(logits: torch.Tensor, index: int, needed: bool) -> float:
    """A greedy draft token's probability under its drafter: the softmax of the drafter's
    logits (`[1, n]`) at `index`, or 1.0 where no confidence bar needs it (no softmax then)."""
    if not needed:
        return 1.0
    return float(torch.softmax(logits[0].float(), dim=-1)[index])


class DraftRandom:
    """A seeded request's numbers for a drafter's own draws. Each draw seeds the generator
    afresh from the request's seed (plus the drafter's offset, so it never shares a stream
    with the verifier's draws), the number of tokens committed so far and the draw's index
    since then. No number is drawn twice for a sequence (the committed count only grows), and
    a request continued on another engine with its output drafts what it would have drafted."""

    __slots__ = ("committed", "generator", "index", "seed")

    def __init__(self, seed: int) -> None:
        self.seed, self.generator = seed, torch.Generator()
        self.committed, self.index = -1, 0

    def next(self, committed: int) -> torch.Generator:
        """The generator for the next draw, `committed` tokens into the sequence."""
        if committed != self.committed:
            self.committed, self.index = committed, 0
        self.generator.manual_seed(step_seed(step_seed(self.seed, committed), self.index))
        self.index += 1
        return self.generator


def draft_random(params: SamplingParams, offset: int) -> DraftRandom | None:
    """A seeded request's numbers for a drafter's draws (None for an unseeded one)."""
    return None if params.seed is None else DraftRandom(params.seed + offset)


class DraftStateError(RuntimeError):
    """The drafter's view of a sequence disagrees with the verifier's."""


def check_view(request: DraftRequest, num_tokens: int) -> None:
    """Raise if the drafter has seen a different number of tokens than the verifier asks for."""
    if num_tokens != request.num_tokens:
        raise DraftStateError(
            f"{request.request_id}: drafter has {num_tokens} tokens, verifier {request.num_tokens}"
        )
