"""The engine's steps launched ahead (async scheduling, `EngineConfig.async_scheduling`): each
call launches the next plain decode step, then commits the one launched before it while the
device runs the new one. workers/engine/overlap.py says which steps may go ahead and how one is
launched; this holds the pipeline's state for one `LLMEngine` and times its steps.

Steps in the pipeline are timed commit to commit: a step's report (`StepReport`, for metrics and
traces) starts where the last step's commit ended, or at its launch if that came later. From
launch to commit would span the next step's launch too, about two step periods.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workers.engine.overlap import Launched, launch, may_go_ahead, plain_decode
from workers.engine.sampler import DeviceSampler

if TYPE_CHECKING:
    from workers.engine.llm_engine import LLMEngine


class AsyncSteps:
    """One engine's launched step and its timing (module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.launched: Launched | None = None  # launched, not yet committed
        self.last_commit = 0.0  # perf_counter when the last step's commit ended (any step's)
        self.num_steps = 0  # steps launched ahead since the engine started

    def step(self) -> bool:
        """Launch the next step where it may go ahead, then commit the one launched before;
        whether this call did a step (False: the engine runs one synchronously)."""
        launched, self.launched = self.launched, None
        self.launched = self._launch_ahead(launched)  # before reading `launched`'s tokens
        if launched is not None:
            self._commit(launched)
        return launched is not None or self.launched is not None

    def _launch_ahead(self, ahead: Launched | None) -> Launched | None:
        """The next step launched where it is a plain decode of every running sequence, fed
        `ahead`'s tokens on the device where that step is still to be committed; None where
        this step runs synchronously (workers/engine/overlap.py says when)."""
        engine = self.engine
        scheduler, config, speculator = engine.scheduler, engine.config, engine.speculator
        running, load = scheduler.running, scheduler.num_unfinished
        admits = scheduler.waiting and len(running) < config.max_num_seqs  # a step of its own
        on_device = engine.sampler if isinstance(engine.sampler, DeviceSampler) else None
        if admits or not may_go_ahead(running, ahead, config.max_num_batched_tokens, on_device):
            return None
        drafting = any(s.spec_method != "none" for s in running)
        if (drafting and speculator.speculates_at(load)) or speculator.hidden_layers(running, load):
            return None
        step = plain_decode(running, ahead)
        if step is None:
            return None
        if drafting:  # nobody drafts at this load; drafters still take their call
            speculator.propose(running, load)
        self.num_steps += 1
        return launch(engine.runner, step, ahead, on_device)

    def _commit(self, launched: Launched) -> None:
        """Commit a launched step's tokens as a synchronous step would, but for sequences that
        ended after it was launched (stopped by the step before, or aborted)."""
        engine = self.engine
        results: list[list[int] | None] = []
        for scheduled, token in zip(launched.seqs, launched.read(), strict=True):
            ended = scheduled.seq.finished
            results.append(None if ended else [token])
            try:
                if not ended:
                    engine._commit(scheduled, [token], [])
            except Exception as exc:  # this request's own failure: it ends alone
                engine._fail(scheduled.seq, exc)
        if engine.step_listeners:
            begin = max(launched.start, self.last_commit)
            begin_ns = launched.start_ns + int((begin - launched.start) * 1e9)
            engine._report(launched.seqs, results, (begin_ns, 0.0, begin))
        self.last_commit = time.perf_counter()
