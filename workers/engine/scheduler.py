"""Which tokens of which sequences go into the next forward, by token counts.

Every sequence has tokens (prompt + committed output) and a count of those already in the KV
cache; a step brings each scheduled sequence's uncomputed tokens (a prefill chunk, or the last
token when decoding) plus, when decoding, its draft. Prefill, chunked prefill, decode and
verification are one mechanism under one token budget (as vLLM's v1 scheduler does it).
Running sequences go first, in the order they were admitted; when the cache runs out of blocks
the least urgent, newest running sequence is preempted (its blocks freed, to be recomputed later:
all but its last token, which a decode step then verifies with drafts, so a seeded request draws
as if never preempted). Waiting sequences are admitted after that, reusing cached prefix
blocks. Who is admitted first, how much of a step one tenant's sequences may fill and who is
preempted for a more urgent request are the fair share's (workers/engine/fair_share.py); with
one tenant and one priority that is first come, first served.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kernels.tree_attention import tree_of
from workers.drafting.base import EMPTY_DRAFT, Draft
from workers.engine.config import EngineConfig
from workers.engine.fair_share import FairShare
from workers.engine.model_runner import SeqForward
from workers.engine.sequence import SeqStatus, Sequence
from workers.kv_cache import NoFreeBlocksError


@dataclass(slots=True)  # not frozen: made for every sequence every step, and never changed
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # of seq.token_ids, starting at seq.num_computed_tokens
    draft: Draft  # verified in the same forward (empty unless decoding)
    decoding: bool  # a verify step: the sequence had its last committed token to feed
    # A draft tree's accepted path: the rows its committed tokens were decided at (verify)
    path: list[int] | None = None

    @property
    def samples(self) -> bool:
        """This forward reaches the sequence's last token, so it yields new tokens."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)

    def forward(self) -> SeqForward:
        seq, draft, num_new = self.seq, self.draft.token_ids, self.num_new_tokens
        start = seq.num_computed_tokens
        new = seq.token_ids[start : start + num_new] + draft
        if seq.scores_prompt:  # every position of the prompt chunk (the sampling row last)
            num_logits = num_new
        elif self.samples:  # its last token's row and one per draft token
            num_logits = 1 + len(draft)
        else:  # a prefill chunk short of the prompt's end
            num_logits = 0
        table, parents = seq.block_table, self.draft.parents
        tree = None if parents is None else tree_of(start, parents)
        return SeqForward(new, start, table.block_ids, num_logits, table.version, tree)


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Since start, for the engine's metrics: sequences preempted, steps given up for an
        # arrival (`give_back`), and prompt tokens looked up in the prefix cache at first
        # admission and found there.
        self.num_preemptions = 0
        self.num_steps_given_up = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.fair = FairShare(config.max_step_share)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.fair.join(seq, [*self.waiting, *self.running])
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.fair.forget(seq)
        seq.block_table.release()

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.is_decoding]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._make_room(out)
        budget = self.config.max_num_batched_tokens
        arrivals = self.fair.arrivals(self.waiting, self.running)
        if arrivals and len(self.running) < self.config.max_num_seqs:
            # Their prefills alone (fair_share.py); the running sequences sit this step out.
            self.fair.arrivals_alone()
            self._admit_waiting(out, budget, only=arrivals)
            if out.seqs:
                return out
        made_room = len(out.preempted)
        budget = self._schedule_running(out, budget)
        if len(out.preempted) == made_room:  # out of blocks this step: admit nobody
            self._admit_waiting(out, budget)
        return out

    def _scheduled(self, out: SchedulerOutput, scheduled: ScheduledSeq) -> None:
        """Add a sequence to the step and charge its tenant (so the next choice sees it)."""
        out.seqs.append(scheduled)
        self.fair.charge(scheduled.seq, scheduled.num_new_tokens + len(scheduled.draft.token_ids))

    def give_back(self, out: SchedulerOutput) -> None:
        """A step given up before anything of it was committed (workers/engine/
        step_interrupt.py): its tenants' charges taken back. Its sequences stay as they are,
        their blocks for the step's tokens held, and the next step schedules them again."""
        self.num_steps_given_up += 1
        for s in out.seqs:
            self.fair.refund(s.seq, s.num_new_tokens + len(s.draft.token_ids))

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt running sequences (less urgent ones, or those of a tenant over its share of
        the places) where the next waiting one finds the running set full or too few free
        blocks for its tokens."""
        while self.waiting and self.running:
            seq = self.fair.next_waiting(self.waiting, self.running)
            assert seq is not None
            needed = -(-(len(seq.token_ids) + 1) // self.config.block_size)
            free = seq.block_table.allocator.num_free_blocks
            if len(self.running) < self.config.max_num_seqs and needed <= free:
                return
            victim = self.fair.preempts_for(seq, self.running, self.config.max_num_seqs)
            if victim is None:
                return
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        serving = self.fair.step_order(self.running, self.config.max_num_seqs)
        i = 0
        while i < len(serving) and budget > 0:
            seq = serving[i]
            decoding = seq.is_decoding
            num_new = 1 if decoding else min(seq.num_tokens_to_compute, budget)
            draft = seq.draft
            if not decoding:
                draft = EMPTY_DRAFT
            elif draft.token_ids:
                draft = draft.truncated(budget - num_new)
            start = seq.num_computed_tokens
            try:
                copies = seq.block_table.prepare_write(
                    start, start + num_new + len(draft.token_ids)
                )
            except NoFreeBlocksError:
                # The least urgent, newest of those not served yet this step (this one too).
                order = {id(s): n for n, s in enumerate(self.running)}
                victim = max(serving[i:], key=lambda s: (s.share.priority, order[id(s)]))
                self.running.remove(victim)
                serving.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                continue  # retry this sequence (unless it was the victim: then the next)
            self._scheduled(out, ScheduledSeq(seq, num_new, draft, decoding))
            if copies:
                out.block_copies += copies
            budget -= num_new + len(draft.token_ids)
            i += 1
        return budget

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, only: set[int] | None = None
    ) -> None:
        """Admit waiting sequences in the fair share's order (of those in `only`, by id)."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            candidates = (
                self.waiting if only is None else [s for s in self.waiting if id(s) in only]
            )
            seq = self.fair.next_waiting(candidates, self.running)
            if seq is None:
                return
            cache = self.config.enable_prefix_caching and not seq.scores_prompt
            if cache and seq.num_computed_tokens == 0:
                # Leave at least the last token to compute: its logits are needed. A sequence
                # with output leaves the one before too: this step computes it, and the next
                # verifies the last with drafts (only running sequences draft).
                keep = 2 if seq.num_output_tokens else 1
                seq.num_computed_tokens = seq.block_table.use_cached_prefix(seq.token_ids[:-keep])
                if not seq.num_output_tokens:  # its first admission (not after preemption)
                    seq.num_cached_tokens = seq.num_computed_tokens
                    self.prefix_queried_tokens += len(seq.token_ids) - 1
                    self.prefix_hit_tokens += seq.num_computed_tokens
            num_new = min(seq.num_tokens_to_compute, budget)
            start = seq.num_computed_tokens
            try:
                copies = seq.block_table.prepare_write(start, start + num_new)
            except NoFreeBlocksError:
                seq.block_table.release()
                seq.num_computed_tokens = 0
                return
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._scheduled(out, ScheduledSeq(seq, num_new, EMPTY_DRAFT, seq.is_decoding))
            out.block_copies += copies
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.block_table.release()
        seq.num_computed_tokens = 0
        seq.draft = EMPTY_DRAFT
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
