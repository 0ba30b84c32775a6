"""Drafting ahead, for the model drafters (`DraftsAhead`): while the verifier checks a proposal,
the drafter drafts the next one on the guess that the whole proposal is accepted, and answers
the next step at once where the guess held. Each sequence keeps a running rate of proposals
accepted whole; below `MIN_WHOLE_RATE` guessing does not pay and the sequence is not drafted
ahead. Where the drafter lives in its own actor, cluster/drafter_worker.py runs this on a thread
beside the verifier's steps."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from workers.drafting.base import (
    EMPTY_DRAFT,
    ConfidenceStop,
    Draft,
    Drafter,
    DraftRequest,
    check_view,
)

# Drafting ahead breaks even at a whole-acceptance rate of 1 / (2k + 1) (0.11 at k = 4); the
# threshold leaves a margin: a drafter working beside the verifier shares the memory bandwidth
# and slows its forward (Qwen2.5-Coder-0.5B beside the 1.5B on a 2-vCPU EPYC: 1.42x in one run,
# none in another; docs/benchmarks.md, `Running both at once`).
MIN_WHOLE_RATE = 0.2
WHOLE_RATE_DECAY = 0.8  # the weight of the past in the running rate: about the last 5 proposals
KEEP_GOING_DRAFTS = 2  # how many proposals (each with its guess) a chain holds at most


@dataclass(slots=True)
class AheadState:
    """One sequence's drafting-ahead bookkeeping."""

    draft: list[int] = field(default_factory=list)  # the last proposal
    whole_rate: float = 1.0  # running share of proposals accepted whole (hopeful at first)
    guess: list[int] | None = None  # the commit a prepared draft assumes
    prepared: Draft | None = None  # drafted ahead on that guess
    ready: Draft | None = None  # a prepared draft whose guess came true
    # Drafting ahead that goes on (`keep_going`): the tokens drawn after the last proposal
    # (the guessed bonus token, then the next draft, then the guess after it), with q for each
    # (sampled drafts) and the drafter's probability of each (for the confidence bar).
    following: bool = False  # a thread is extending `chain`
    k: int = 0  # the length of the draft in the chain
    chain: list[int] = field(default_factory=list)
    chain_q: list[torch.Tensor] = field(default_factory=list)
    chain_p: list[float] = field(default_factory=list)

    @property
    def worth_it(self) -> bool:
        """Whether drafting ahead for this sequence pays, by its whole-acceptance rate."""
        return self.whole_rate >= MIN_WHOLE_RATE

    def committed(self, token_ids: Sequence[int]) -> None:
        if self.draft:
            whole = list(token_ids[: len(self.draft)]) == self.draft
            self.whole_rate = WHOLE_RATE_DECAY * self.whole_rate + (1 - WHOLE_RATE_DECAY) * whole
        hit = self.guess is not None and list(token_ids) == self.guess
        self.ready = self.prepared if hit else None
        self.guess, self.prepared, self.draft = None, None, []

    def keep(self, ahead: Draft) -> bool:
        """Keep a draft made ahead (the bonus-token guess, then the next proposal); False when
        it was cut short before the proposal's first token."""
        if len(ahead.token_ids) < 2:
            return False
        self.guess = self.draft + ahead.token_ids[:1]
        probs = None if ahead.probs is None else ahead.probs[1:]
        self.prepared = Draft(ahead.token_ids[1:], probs)
        return True

    # -- the chain -----------------------------------------------------------------------------

    def follow(self, k: int) -> None:
        """Start a chain after the last proposal, for drafts of `k` tokens."""
        self.following, self.k = True, k
        self.chain, self.chain_q, self.chain_p = [], [], []

    def extend(self, token: int, q: torch.Tensor | None, probability: float) -> None:
        self.chain.append(token)
        if q is not None:
            self.chain_q.append(q)
        self.chain_p.append(probability)

    def draft_in_chain(self, min_confidence: float, k: int | None = None) -> tuple[int, bool]:
        """How many chain tokens after the guess form the next draft (at most `k`, default the
        chain's, ending with the token whose probability crosses the bar), and whether that
        draft is complete."""
        k = self.k if k is None else k
        bar = ConfidenceStop(min_confidence)
        n = 0
        for probability in self.chain_p[1 : 1 + k]:
            n += 1
            bar.drew(probability)
            if not bar.sure:
                return n, True
        return n, n == k

    def holds_draft(self, k: int, min_confidence: float) -> bool:
        """Whether the chain holds the guess and the whole draft after it: the proposal of at
        most `k` tokens an in-line `propose` would make (k tokens, or fewer where the bar ends
        the draft)."""
        return bool(self.chain) and self.draft_in_chain(min_confidence, k)[1]

    def wants_more(self, min_confidence: float, keep_going: bool) -> bool:
        """Whether the chain needs another token: until its draft is complete; drafting ahead
        that goes on, past that draft's end and the guess after it, through the draft after
        that too (the drafter's core would idle otherwise while the verifier checks the draft,
        and the next step would wait for all of its draft)."""
        if keep_going:
            return len(self.chain) < KEEP_GOING_DRAFTS * (self.k + 1)
        return not self.draft_in_chain(min_confidence)[1]

    def guessed(self, token_ids: Sequence[int]) -> bool:
        """Whether the commit `token_ids` is the chain's guess (known once its first token is)."""
        return bool(self.chain) and list(token_ids) == self.draft + self.chain[:1]

    def missed(self, token_ids: Sequence[int]) -> bool:
        """Whether the chain's guess is known and the commit `token_ids` is not it."""
        return bool(self.chain) and not self.guessed(token_ids)

    def take(self, k: int, min_confidence: float) -> Draft:
        """The guess was committed: its draft (the ready part, cut to `k`) becomes the last
        proposal, and the chain goes on after it (the guess after it comes first)."""
        if self.draft:
            self.whole_rate = WHOLE_RATE_DECAY * self.whole_rate + (1 - WHOLE_RATE_DECAY)
        n = min(self.draft_in_chain(min_confidence)[0], k)
        tokens = self.chain[1 : 1 + n]
        probs = torch.cat(self.chain_q[1 : 1 + n]) if self.chain_q and n else None
        del self.chain[: 1 + n], self.chain_p[: 1 + n]
        if self.chain_q:
            del self.chain_q[: 1 + n]
        self.draft, self.k = tokens, k
        return Draft(tokens, probs)

    def settle(self, min_confidence: float) -> bool:
        """Drafting ahead ended: what the chain holds becomes the usual guess and prepared
        draft (`keep`); True when a draft was prepared."""
        n = 1 + self.draft_in_chain(min_confidence)[0]
        probs = torch.cat(self.chain_q[:n]) if self.chain_q else None
        kept = self.keep(Draft(self.chain[:n], probs))
        self.following = False
        self.chain, self.chain_q, self.chain_p = [], [], []
        return kept


class AheadSequence(Protocol):
    tokens: list[int]  # committed
    ahead: AheadState


class DraftsAhead(Drafter):
    """A drafter that drafts ahead: its sequences carry their committed `tokens` and an
    `AheadState` (`commit` must call `ahead.committed`), and its `_draft` drafts after given
    (`forced`) tokens. `propose` serves a prepared draft when the last commit was its guess and
    drafts the others with `_draft`."""

    drafts_ahead = True
    max_model_len: int
    _seqs: Mapping[str, AheadSequence]

    @abstractmethod
    def _draft(
        self,
        active: list[tuple[str, Any, list[int], int]],
        stop: Callable[[], bool],
        abandon: Callable[[], bool] | None = None,
    ) -> dict[str, Draft]:
        """Draft `n` tokens for each (request, sequence, forced, n): after the committed tokens
        and then the `forced` ones (a previous draft, when drafting ahead; none for a
        proposal). Drafts come back short when `stop()` turns true (checked between forwards;
        it is true whenever `abandon()` is) or `abandon()` does (checked inside a forward too,
        where the drafter can; None for a proposal, which is never abandoned)."""

    def ahead_may_hold(self, request_id: str, token_ids: Sequence[int]) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or not seq.ahead.draft:
            return False
        draft = seq.ahead.draft
        return len(token_ids) > len(draft) and list(token_ids[: len(draft)]) == draft

    def _can_draft(self, seq: Any) -> bool:
        """Whether the drafter has what drafting for `seq` needs (default: always)."""
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        drafts: dict[str, Draft] = {}
        active: list[tuple[str, Any, list[int], int]] = []
        for req in requests:
            seq = self._seqs[req.request_id]
            check_view(req, len(seq.tokens))
            k = min(req.k, self.max_model_len - len(seq.tokens))
            ready, seq.ahead.ready = seq.ahead.ready, None
            drafts[req.request_id] = EMPTY_DRAFT
            if ready is not None and k > 0:  # the last commit was the guess
                drafts[req.request_id] = ready.truncated(k)
                self.ahead_served += 1
            elif k > 0 and self._can_draft(seq):
                active.append((req.request_id, seq, [], k))
        if active:
            drafts.update(self._draft(active, lambda: False))
        for rid, draft in drafts.items():
            self._seqs[rid].ahead.draft = draft.token_ids
        return drafts

    @torch.inference_mode()
    def draft_ahead(
        self,
        requests: Sequence[DraftRequest],
        stop: Callable[[], bool] = lambda: False,
        abandon: Callable[[], bool] = lambda: False,
        keep_going: bool = False,
    ) -> None:
        active: list[tuple[str, Any, list[int], int]] = []
        for req in requests:
            seq = self._seqs.get(req.request_id)
            if seq is None or not (seq.ahead.draft and seq.ahead.worth_it):
                continue
            if not self._can_draft(seq):
                continue
            # The guess commits the draft and a bonus token; k more must still fit.
            draft = seq.ahead.draft
            k = min(req.k, self.max_model_len - len(seq.tokens) - len(draft) - 1)
            if k > 0:
                active.append((req.request_id, seq, draft, k + 1))
        if active:
            drafts = self._draft(active, lambda: stop() or abandon(), abandon)
            for rid, seq, _, _ in active:
                self.ahead_prepared += seq.ahead.keep(drafts[rid])
