"""A step given up for an arrival (fair share's "arrivals first", workers/engine/
fair_share.py).

A request of a tenant with nothing running may arrive just after a step of the other tenants'
began; its prefill would wait for that step (32 rows on two CPU cores take 30-40 ms, more than
the prefill itself). The engine loop (workers/engine/engine_loop.py) hears of a
request before the engine does: after each layer of its forward the step asks it for the
requests that have come (`Arrivals`), and where the fair share lets one in at once
(`FairShare.comes_first`, the rule its own arrival steps follow), the forward is
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
    from workers.engine.fair_share import Share
    from workers.engine.model_runner import ModelRunner
    from workers.engine.scheduler import Scheduler, SchedulerOutput

# The shares of the requests that have come and are not taken in yet.
Arrivals = Callable[[], "Sequence[Share]"]


def interrupt_for(
    arrived: Arrivals | None,
    scheduler: Scheduler,
    runner: ModelRunner,
    batch: SchedulerOutput,
    hidden_layers: Sequence[int],
) -> Callable[[], bool] | None:
    """The forward's `interrupt` for this step, or None where it may not be given up."""
    if arrived is None or not runner.interruptible or not scheduler.fair.capped:
        return None
    if hidden_layers or any(s.draft.token_ids or s.seq.draft.token_ids for s in batch.seqs):
        return None
    first = scheduler.fair.comes_first(scheduler.running)  # the step's sequences run
    return lambda: any(first(share) for share in arrived())
