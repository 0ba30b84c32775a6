"""Drafting with a smaller model that shares the target's tokenizer.

The draft model has its own paged KV cache. For each sequence it remembers which tokens its
cache holds (the committed prefix plus its own last draft); after a verification it keeps the
longest common prefix of those and the committed tokens, frees the rest (rollback), and the next
proposal first feeds what is missing (the prompt the first time, then the recovered or bonus
token) before drafting k tokens one forward at a time, batched over sequences. Drafts are drawn
from the draft model's distribution after the same temperature/top-k/top-p/min-p transform the
target uses, and that distribution (q) is returned for the rejection test. A draft ends early
once the model's probability of it falls below `min_confidence` (base.py `ConfidenceStop`).

Drafting ahead (base.py): the cache continues past the last draft with the model's own choice of
the bonus token and the next k tokens; a commit equal to that guess leaves the cache holding
exactly what the next proposal needs, so the prepared draft is served as it is. Abandoned, a
forward stops between two layers, and the slots it had claimed are rolled back. Drafting ahead
that goes on (`keep_going`) extends each sequence's chain one batched forward at a time, on its
thread, and `take_ahead` serves from the chains between two of those forwards: the lock guards
the chains and the committed tokens, never a forward, and only the thread touches the cache
while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kernels.sampling import sample_from_probs
from workers.drafting.ahead import AheadState, DraftsAhead
from workers.drafting.base import (
    ConfidenceStop,
    Draft,
    DraftRandom,
    DraftRequest,
    draft_random,
    greedy_probability,
)
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.kv_cache import BlockAllocator, BlockTable, NoFreeBlocksError, PagedKVCache
from workers.model.transformer import ForwardInterrupted, TransformerLM

# Draws of the draft model must not share a stream with the verifier's draws for the same seed.
_DRAFT_SEED_OFFSET = 0x5EED


@dataclass(slots=True)
class _DraftSeq:
    params: SamplingParams
    table: BlockTable
    random: DraftRandom | None  # a seeded request's numbers
    tokens: list[int] = field(default_factory=list)  # committed
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the draft cache holds
    ahead: AheadState = field(default_factory=AheadState)


class DraftModelDrafter(DraftsAhead):
    method = "draft_model"
    keeps_drafting_ahead = True

    def __init__(
        self,
        model: TransformerLM,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int = 0,
        min_confidence: float = 0.0,
    ) -> None:
        cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        self.allocator = BlockAllocator(num_blocks)
        self.max_model_len = max_model_len or model.config.max_context
        self._seqs: dict[str, _DraftSeq] = {}
        # A draft ends once the draft model's probability of it falls below this (base.py).
        self.min_confidence = min_confidence
        self._chains = threading.Condition()  # drafting ahead that goes on, and take_ahead

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        table = BlockTable(self.allocator, self.runner.block_size)
        draws = draft_random(params, _DRAFT_SEED_OFFSET)
        self._seqs[request_id] = _DraftSeq(params, table, draws, list(prompt_token_ids))

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        seq = self._seqs[request_id]
        seq.tokens.extend(token_ids)
        seq.ahead.committed(token_ids)
        ready = seq.ahead.ready
        keep = seq.tokens + (ready.token_ids if ready is not None else [])
        self._rollback(seq, _common_prefix(seq.cached, keep))

    def remove(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            seq.table.release()

    def _draft(
        self,
        active: list[tuple[str, _DraftSeq, list[int], int]],
        stop: Callable[[], bool],
        abandon: Callable[[], bool] | None = None,
    ) -> dict[str, Draft]:
        # First forward: whatever of the context the cache lacks (at least its last token, for
        # its logits); then one drafted token each.
        pending = {rid: self._to_feed(seq, forced) for rid, seq, forced, _ in active}
        tokens: dict[str, list[int]] = {rid: [] for rid, _, _, _ in active}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid, _, _, _ in active}
        confidence = {rid: ConfidenceStop(self.min_confidence) for rid, _, _, _ in active}
        running = list(active)
        while running and not stop():
            try:
                logits = self._forward([(seq, pending[rid]) for rid, seq, _, _ in running], abandon)
            except NoFreeBlocksError:
                break  # out of draft cache: propose what we have; the verifier copes with less
            except ForwardInterrupted:
                for _, seq, _, _ in running:  # the slots it wrote hold nothing now
                    self._rollback(seq, len(seq.cached))
                break
            for row, (rid, seq, _, _) in enumerate(running):
                seq.cached.extend(pending[rid])
                token, q, p = self._sample(seq, logits[row : row + 1])
                tokens[rid].append(token)
                if q is not None:
                    probs[rid].append(q)
                pending[rid] = [token]
                confidence[rid].drew(p)
            running = [e for e in running if len(tokens[e[0]]) < e[3] and confidence[e[0]].sure]
        return {
            rid: Draft(tokens[rid], torch.cat(probs[rid]) if probs[rid] else None)
            for rid, _, _, _ in active
        }

    @torch.inference_mode()
    def draft_ahead(
        self,
        requests: Sequence[DraftRequest],
        stop: Callable[[], bool] = lambda: False,
        abandon: Callable[[], bool] = lambda: False,
        keep_going: bool = False,
    ) -> None:
        # One chain per sequence (base.py AheadState), extended a batched forward at a time.
        with self._chains:
            active = []
            for req in requests:
                seq = self._seqs.get(req.request_id)
                if seq is not None and seq.ahead.draft and seq.ahead.worth_it:
                    seq.ahead.follow(req.k)
                    active.append(seq)
        pending = [self._to_feed(seq, seq.ahead.draft) for seq in active]
        try:
            while active and not (stop() or abandon()):
                with self._chains:
                    running = [i for i, seq in enumerate(active) if self._extends(seq, keep_going)]
                    if not running:
                        if not keep_going:
                            break
                        self._chains.wait_for(  # a proposal taken from the chains, or stop
                            lambda: (
                                stop()
                                or abandon()
                                or any(self._extends(seq, True) for seq in active)
                            ),
                            timeout=0.5,  # stop() is also polled, should a wake be missed
                        )
                        continue
                try:
                    logits = self._forward([(active[i], pending[i]) for i in running], abandon)
                except NoFreeBlocksError:
                    break  # out of draft cache: the chains end here
                except ForwardInterrupted:
                    for i in running:  # the slots it wrote hold nothing now
                        self._rollback(active[i], len(active[i].cached))
                    break
                with self._chains:
                    for row, i in enumerate(running):
                        seq = active[i]
                        seq.cached.extend(pending[i])
                        token, q, p = self._sample(seq, logits[row : row + 1])
                        seq.ahead.extend(token, q, p)
                        pending[i] = [token]
                    self._chains.notify_all()
        finally:
            with self._chains:
                for seq in active:
                    self.ahead_prepared += seq.ahead.settle(self.min_confidence)
                self._chains.notify_all()

    def _extends(self, seq: _DraftSeq, keep_going: bool) -> bool:
        """Whether drafting ahead draws another token for the sequence (called with the lock)."""
        ahead = seq.ahead
        room = len(seq.tokens) + len(ahead.draft) + len(ahead.chain) < self.max_model_len
        return room and ahead.wants_more(self.min_confidence, keep_going)

    def take_ahead(
        self,
        commits: Mapping[str, Sequence[int]],
        requests: Sequence[DraftRequest],
        timeout: float,
    ) -> dict[str, Draft] | None:
        if not requests or set(commits) != {req.request_id for req in requests}:
            return None
        with self._chains:
            seqs = [self._seqs.get(req.request_id) for req in requests]
            for req, seq in zip(requests, seqs, strict=True):
                tokens = commits[req.request_id]
                if seq is None or not seq.ahead.following:
                    return None
                if len(seq.tokens) + len(tokens) != req.num_tokens:
                    return None  # the usual path reports it
                if list(tokens[:-1]) != seq.ahead.draft:  # not the last draft accepted whole
                    return None
            # The guess and the whole draft after it, each: the forwards under way may still be
            # making them. A guess that proved wrong ends the wait (nothing will be served).
            waits = [
                (
                    seq,
                    commits[req.request_id],
                    max(0, min(req.k, self.max_model_len - req.num_tokens)),
                )
                for req, seq in zip(requests, seqs, strict=True)
                if seq is not None
            ]
            self._chains.wait_for(
                lambda: (
                    any(seq.ahead.missed(commit) for seq, commit, _ in waits)
                    or all(self._ready(seq, k) for seq, _, k in waits)
                ),
                timeout,
            )
            if not all(
                seq is not None and seq.ahead.guessed(commits[req.request_id])
                for req, seq in zip(requests, seqs, strict=True)
            ):
                return None
            drafts: dict[str, Draft] = {}
            for req, seq in zip(requests, seqs, strict=True):
                assert seq is not None
                seq.tokens.extend(commits[req.request_id])
                k = max(0, min(req.k, self.max_model_len - len(seq.tokens)))
                drafts[req.request_id] = draft = seq.ahead.take(k, self.min_confidence)
                self.ahead_prepared += bool(draft.token_ids)
                self.ahead_served += bool(draft.token_ids)
            self._chains.notify_all()
            return drafts

    def _ready(self, seq: _DraftSeq, k: int) -> bool:
        """Whether a sequence's chain can be taken from now (called with the lock): once it
        holds the guess and the whole draft of at most `k` tokens after it, the draft an in-line
        proposal would make, or once it will grow no more. Serving less as soon as it is ready
        makes steps shorter but their drafts too, and acceptance per step falls: with
        Qwen2.5-Coder-0.5B drafting for the 1.5B on code, a chain served at its first draft token
        averaged 3.1 tokens a step against 4.6 in-line (docs/benchmarks.md)."""
        ahead = seq.ahead
        # The chain's drafts are at most its own k long (`take` serves no more).
        if not ahead.following or ahead.holds_draft(min(k, ahead.k), self.min_confidence):
            return True
        return bool(ahead.chain) and not self._extends(seq, True)

    def wake_ahead(self) -> None:
        with self._chains:
            self._chains.notify_all()

    def _to_feed(self, seq: _DraftSeq, forced: list[int]) -> list[int]:
        """Roll the cache back to what it shares with the committed tokens and then `forced`
        ones, and return the rest of those (at least the last: its logits draw the next)."""
        context = seq.tokens + forced
        common = min(_common_prefix(seq.cached, context), len(context) - 1)
        self._rollback(seq, common)
        return context[common:]

    def _forward(
        self, batch: list[tuple[_DraftSeq, list[int]]], interrupt: Callable[[], bool] | None
    ) -> torch.Tensor:
        forwards = []
        for seq, new in batch:
            start = len(seq.cached)
            seq.table.prepare_write(start, start + len(new))
            forwards.append(SeqForward(new, start, seq.table.block_ids))
        return self.runner.forward(forwards, interrupt=interrupt).output.logits  # [batch, vocab]

    def _sample(
        self, seq: _DraftSeq, logits: torch.Tensor
    ) -> tuple[int, torch.Tensor | None, float]:
        """(token, q or None when greedy, the model's probability of the token: 1.0 unless a
        confidence bar needs it)."""
        params = seq.params
        if params.greedy:
            token = int(logits[0].argmax())
            return token, None, greedy_probability(logits, token, self.min_confidence > 0)
        q = params.probs(logits)
        draws = None if seq.random is None else seq.random.next(len(seq.tokens))
        token = int(sample_from_probs(q, [draws])[0])
        return token, q, float(q[0, token])

    @staticmethod
    def _rollback(seq: _DraftSeq, num_tokens: int) -> None:
        del seq.cached[num_tokens:]
        seq.table.truncate(num_tokens)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
