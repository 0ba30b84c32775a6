"""The engine loop (workers/engine/engine_loop.py): the background thread that steps an
engine for callers on other threads and event loops, on a tiny random model."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from tests.unit.test_engine import GREEDY, engine, model, prompts
from workers.engine.engine_loop import EngineLoop
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_interrupt import Arrivals
from workers.model.transformer import TransformerLM

__all__ = ["model"]  # the module-scoped fixture, shared


@dataclasses.dataclass(frozen=True, slots=True)
class _FailingParams(SamplingParams):
    """Sampling parameters whose logit adjustment raises."""

    def adjust(self, logits: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("boom in adjust")


def test_the_engine_loop_hands_a_failed_request_its_error_and_serves_the_rest(
    model: TransformerLM,
) -> None:
    ps = prompts(2, seed=3)
    (expected,) = engine(model).generate([ps[0]], GREEDY)
    loop = EngineLoop(engine(model))
    try:
        good = loop.submit("good", ps[0], GREEDY)
        bad = loop.submit("bad", ps[1], _FailingParams(max_tokens=12, logit_bias=((5, 0.0),)))
        with pytest.raises(RuntimeError, match="boom in adjust"):
            list(bad)
        assert [t for out in good for t in out.new_token_ids] == expected.token_ids
        assert loop.ready()
    finally:
        loop.close()


def test_the_engine_loop_shows_a_failed_step_to_its_fatal_hook_first(
    model: TransformerLM,
) -> None:
    """A verifier's hook sees the step's exception before the running requests get it (a
    broken tensor-parallel group ends the process there instead); then the loop goes on."""
    eng = engine(model)
    real_step = eng.step
    seen: list[str] = []

    def step_failing_once(arrived: Arrivals | None = None) -> list[RequestOutput]:
        if not seen:
            raise RuntimeError("the group broke")
        return real_step(arrived)

    def fatal(exc: Exception) -> None:
        seen.append(f"{exc} while {sorted(loop._streams)} still ran")

    eng.step = step_failing_once  # type: ignore[method-assign]
    loop = EngineLoop(eng, fatal)
    try:
        failed = loop.submit("a", prompts(1, seed=5)[0], GREEDY)
        with pytest.raises(RuntimeError, match="the group broke"):
            list(failed)
        assert seen == ["the group broke while ['a'] still ran"]
        served = loop.submit("b", prompts(1, seed=6)[0], GREEDY)
        assert len([t for out in served for t in out.new_token_ids]) == GREEDY.max_tokens
    finally:
        loop.close()


def test_the_engine_loop_aborts_a_request_whose_caller_loop_closed(model: TransformerLM) -> None:
    """A stream's event loop closed with the request still running (a router thread that
    stopped): the engine loop aborts it instead of dying on the closed loop, and serves on."""
    loop = EngineLoop(engine(model))
    try:
        caller = asyncio.new_event_loop()
        long = dataclasses.replace(GREEDY, max_tokens=200)
        gone = loop.stream("gone", prompts(1, seed=7)[0], long)
        caller.run_until_complete(anext(gone))
        caller.close()  # without closing the stream: no abort is sent
        served = loop.submit("b", prompts(1, seed=8)[0], GREEDY)
        assert len([t for out in served for t in out.new_token_ids]) == GREEDY.max_tokens
        assert loop.ready() and not loop.engine.has_unfinished_requests()
    finally:
        loop.close()


def test_the_engine_loop_hands_a_steps_outputs_to_an_event_loop_at_once(
    model: TransformerLM,
) -> None:
    """Streams on one event loop get every output, in order, and the loop thread wakes that
    event loop once a step for all of them (not once a request)."""
    eng = engine(model)
    expected = eng.generate(prompts(4, seed=9), GREEDY)
    loop = EngineLoop(eng)

    async def run() -> tuple[list[list[int]], int]:
        caller = asyncio.get_running_loop()
        wakes = 0
        real = caller.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(*args, **kwargs)

        caller.call_soon_threadsafe = counted  # type: ignore[method-assign]
        streams = [loop.stream(f"s{i}", p, GREEDY) for i, p in enumerate(prompts(4, seed=9))]

        async def tokens(stream: Any) -> list[int]:
            return [t async for out in stream for t in out.new_token_ids]

        got = await asyncio.gather(*(tokens(s) for s in streams))
        return got, wakes

    try:
        got, wakes = asyncio.run(run())
    finally:
        loop.close()
    assert got == [c.token_ids for c in expected]
    # One wake-up a step (a token each), not one per request: 4 x 12 would be 48.
    assert wakes <= GREEDY.max_tokens + 2


def test_an_outputs_counts_are_those_of_its_step(model: TransformerLM) -> None:
    """An output read after the engine stepped on (as a reader on another thread may) keeps its
    own step's speculation counts: a stop string found there ends the answer at that step."""
    eng = engine(model)
    eng.add_request("r", prompts(1, seed=5)[0], GREEDY)
    first = [out for _ in range(3) for out in eng.step()]
    eng.step()
    assert [out.spec.verify_steps for out in first] == [0, 1, 2]


def test_outputs_handed_over_on_the_loop_thread_then_once_a_step(model: TransformerLM) -> None:
    """`start(on_loop_thread=True)`: the consumer is called on the loop thread itself, with
    every output in order, and `handed_over` after each step's, no event loop woken."""
    import threading

    eng = engine(model)
    expected = eng.generate(prompts(3, seed=5), GREEDY)
    got: dict[str, list[int]] = {f"t{i}": [] for i in range(3)}
    threads: set[threading.Thread] = set()
    events: list[str] = []
    done = threading.Event()

    def handed_over() -> None:
        events.append("handed over")

    loop = EngineLoop(eng, handed_over=handed_over)

    def consumer(request_id: str) -> Any:
        def consume(item: RequestOutput | Exception) -> None:
            assert isinstance(item, RequestOutput)
            threads.add(threading.current_thread())
            got[request_id] += item.new_token_ids
            events.append("output")
            if all(len(t) == GREEDY.max_tokens for t in got.values()):
                done.set()

        return consume

    async def run() -> None:
        for i, p in enumerate(prompts(3, seed=5)):
            loop.start(f"t{i}", p, GREEDY, None, None, None, consumer(f"t{i}"), on_loop_thread=True)

    try:
        asyncio.run(run())
        assert done.wait(60)
    finally:
        loop.close()
    assert list(got.values()) == [c.token_ids for c in expected]
    assert threads == {loop._thread}
    # Each step's outputs, then one hand-over: never two outputs of a step apart from it.
    steps = "".join("o" if e == "output" else "|" for e in events).split("|")
    assert max(len(s) for s in steps) <= 3 and sum(len(s) for s in steps) == 3 * GREEDY.max_tokens
