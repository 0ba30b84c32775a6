"""A step given up for an arrival (fair share's "arrivals first", workers/engine/
fair_share.py).

A request of a tenant with nothing running may arrive just after a step of the other tenants'
began; its prefill would wait for that step (32 rows on two CPU cores take 30-40 ms, more than
the prefill itself). The engine loop (workers/engine/engine_loop.py) hears of a
request before the engine does, and the step asks it after each layer of its forward whether
one has come that the fair share would let in at once (`ArrivalCheck`). If so, the forward is
given up (`ForwardInterrupted`), the arrival's prefill runs in a step of its own, and the
others' decodes and prompt chunks run again after it.

Nothing of the step given up was committed, so the text is what it would have been: its K/V
at the new positions is written again by the step that runs them (a prompt's blocks enter the
prefix cache only when committed), its tokens are drawn then (a seeded draw is seeded by its
position: `Sequence.reseed`), and its tenants' charges are taken back (`Scheduler.give_back`).
Only a step that can be given up so is asked: no sequence in it has a draft (no drafter worked
for it), no feature rows go to a drafter, the share cap is on (without it arrivals have no
step of their own), and its runner's forward stops between layers (not a CUDA graph's replay,
nor a tensor-parallel group, whose ranks run every layer together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.model_runner import ModelRunner
    from workers.engine.scheduler import Scheduler, SchedulerOutput

# (the tenants with running sequences, the most urgent running priority) -> whether a request
# has come that the fair share would admit in a step of its own.
ArrivalCheck = Callable[[frozenset[str], int], bool]


def interrupt_for(
    arrived: ArrivalCheck | None,
    scheduler: Scheduler,
    runner: ModelRunner,
    batch: SchedulerOutput,
    hidden_layers: Sequence[int],
) -> Callable[[], bool] | None:
    """The forward's `interrupt` for this step, or None where it may not be given up."""
    if arrived is None or not runner.interruptible or not scheduler.fair.capped:
        return None
    if hidden_layers or not batch.seqs or not scheduler.running:
        return None
    if any(s.draft.token_ids or s.seq.draft.token_ids for s in batch.seqs):
        return None
    busy = frozenset(s.share.tenant for s in scheduler.running)
    urgent = min(s.share.priority for s in scheduler.running)
    return lambda: arrived(busy, urgent)
