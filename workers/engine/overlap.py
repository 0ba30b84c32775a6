"""Async scheduling: the next plain decode step launched before the host reads this one's tokens.

On a GPU a decode step of a small model at batch 64-256 takes about as long on the device as the
host's work around it (scheduling, staging, committing tokens, outputs). Synchronously the two
run in series. With `EngineConfig.async_scheduling` the engine overlaps them where a step is a
plain decode (as vLLM's async scheduler and SGLang's overlap scheduler do):

1. step N is launched: its inputs staged and its forward and greedy argmax queued on the device,
   the tokens' copy to pinned host memory queued behind them (`Launched`);
2. the next call launches step N + 1 at once, its input tokens taken on the device from step N's
   argmax (`ModelRunner.forward`'s `input_tokens`), its positions one further, its cache slots
   prepared; only then does it wait for step N's tokens and commit them (stop checks, text,
   outputs), while the device runs step N + 1.

A sequence's state (`num_computed_tokens`, `token_ids`) stays what the committed steps made it;
the launched step's positions are worked out from it. A sequence that stops at step N (EOS, a
stop string, an abort) was already fed into step N + 1: that step's token for it is dropped, and
the K/V it wrote lands in blocks the sequence's release freed, before any later forward (queued
after it) can use them. A sequence that reaches its `max_tokens` at step N is left out of step
N + 1.

Nothing the host hands the device after a launch waits for it: index tensors and block copies
are queued from pinned memory (kernels/host_copy.py), so the host commits step N while the
device runs N + 1 (`pytest -m cuda` checks that a launched step is still running when its call
returns).

Only steps the host need not look into go ahead: every running sequence decoding, nobody waiting
who could be admitted (a full batch admits nobody), no drafts (nobody speculates at this load, or
nobody asks to), greedy requests, or sampled ones where the engine samples on the device
(`DeviceSampler.sample_next`, keyed by the request and the position, so the token is the one a
synchronous step draws), without logit adjustments, log-probabilities or a grammar, no hidden
states for drafters, a runner that can feed tokens on the device (not a tensor-parallel group's,
whose other ranks need them on the host) and room in the cache without preempting. Any other step
runs synchronously, after the launched one is committed. Greedy and seeded output is the
synchronous engine's, token for token (tests/unit/test_async_scheduling.py); on a CPU, where a
forward runs in the caller's thread, nothing overlaps, and the path is tested for that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kernels.host_copy import queued_tensor
from workers.drafting.base import EMPTY_DRAFT
from workers.engine.model_runner import ModelRunner, RunnerOutput, SeqForward
from workers.engine.sampler import DeviceSampler
from workers.engine.scheduler import ScheduledSeq
from workers.engine.sequence import Sequence
from workers.kv_cache import NoFreeBlocksError


@dataclass(slots=True)
class Launched:
    """A plain decode step queued on the device whose tokens the host has not read."""

    seqs: list[ScheduledSeq]  # committed as a synchronous step's would be
    tokens: torch.Tensor  # [num_seqs] int64 on the model's device: each sequence's next token
    host: torch.Tensor  # [num_seqs] int64, pinned on a GPU: where `tokens` are copied to
    ready: torch.cuda.Event | None  # recorded after the copy (None on a CPU: done already)
    start_ns: int
    start: float

    def read(self) -> list[int]:
        """The step's tokens, once the device has them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def goes_ahead(seq: Sequence, sampler: DeviceSampler | None) -> bool:
    """Whether this sequence's decode step may be launched before the host reads the last one:
    greedy, or sampled where `sampler` draws on the device; nothing to adjust, nothing to
    score, no grammar."""
    params = seq.params
    return (
        (params.greedy or sampler is not None)
        and not seq.adjusts_logits
        and params.logprobs is None
        and seq.grammar is None
        and not seq.scores_prompt
    )


@dataclass(slots=True)
class PlainDecode:
    """A plain decode step's sequences, their forwards and the copy-on-write block copies to
    make before it."""

    steps: list[tuple[ScheduledSeq, SeqForward]]
    copies: list[tuple[int, int]]


def may_go_ahead(
    running: Seq[Sequence], ahead: Launched | None, budget: int, sampler: DeviceSampler | None
) -> bool:
    """Whether the running sequences' next step may be a plain decode launched ahead (of
    `ahead`, where it is still to be committed): each of them goes ahead (`goes_ahead`), all of
    them in `ahead` or, without one, all of them decoding, and no more than `budget` tokens."""
    if not running or len(running) > budget:
        return False
    if not all(goes_ahead(s, sampler) for s in running):
        return False
    if ahead is None:
        return all(s.is_decoding for s in running)
    return {id(s) for s in running} <= {id(s.seq) for s in ahead.seqs}


def plain_decode(seqs: Seq[Sequence], ahead: Launched | None) -> PlainDecode | None:
    """Each sequence's decode step, one position past `ahead`'s where that step is still to be
    committed (its token fed on the device), with its cache slot made writable; None where a
    sequence cannot take one without preempting (the slots already made stay: later steps
    write them). Sequences that `ahead` brings to their last token are left out."""
    step = PlainDecode([], [])
    for seq in seqs:
        position = seq.num_computed_tokens + (ahead is not None)
        if ahead is not None and position + 1 >= seq.token_limit:  # the context's end too
            continue  # its step in `ahead` commits its last token
        table = seq.block_table
        try:
            step.copies += table.prepare_write(position, position + 1)
        except NoFreeBlocksError:
            return None
        token = seq.token_ids[-1] if ahead is None else 0  # fed on the device
        forward = SeqForward([token], position, table.block_ids, 1, table.version)
        step.steps.append((ScheduledSeq(seq, 1, EMPTY_DRAFT, True), forward))
    return step if step.steps else None


def launch(
    runner: ModelRunner, step: PlainDecode, ahead: Launched | None, sampler: DeviceSampler | None
) -> Launched:
    """Queue the step's block copies and forward (fed `ahead`'s tokens where given), its
    tokens (the argmax, or `sampler`'s draw for sampled requests) and their copy to the
    host."""
    start_ns, start = time.time_ns(), time.perf_counter()
    steps = step.steps
    runner.copy_blocks(step.copies)
    fed = None
    if ahead is not None:
        order = {id(s.seq): i for i, s in enumerate(ahead.seqs)}
        index = [order[id(scheduled.seq)] for scheduled, _ in steps]
        fed = ahead.tokens
        if index != list(range(len(ahead.seqs))):
            fed = fed.index_select(0, queued_tensor(index, torch.int64, fed.device))
    output = runner.forward([f for _, f in steps], input_tokens=fed)
    rows = last_rows(output)
    tokens = rows.argmax(dim=-1)
    sampled = [i for i, (s, _) in enumerate(steps) if not s.seq.params.greedy]
    if sampled:
        assert sampler is not None, "sampled requests go ahead only with a device sampler"
        seqs = [steps[i][0].seq for i in sampled]
        at = queued_tensor(sampled, torch.int64, rows.device)
        drawn = sampler.sample_next(
            rows.index_select(0, at).float(), seqs, [steps[i][1].end for i in sampled]
        )
        tokens.index_copy_(0, at, drawn)
    if tokens.is_cuda:
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched([s for s, _ in steps], tokens, host, ready, start_ns, start)
    return Launched([s for s, _ in steps], tokens, tokens, None, start_ns, start)


def last_rows(output: RunnerOutput) -> torch.Tensor:  # [num_seqs, vocab]
    """Each sequence's last scored row: the one its next token comes from."""
    logits = output.output.logits
    ends = [end for _, end in output.logits_spans]
    if ends == list(range(1, len(ends) + 1)):  # one row each, side by side: most steps
        return logits[: len(ends)]
    return logits.index_select(0, queued_tensor([e - 1 for e in ends], torch.int64, logits.device))
