"""The prefill client's turns on its workers (cluster/prefill_client.py `WorkerTurns`): one
prompt at a time on a worker, in order; once a worker is passed over, the prompts still queued
for it give it up at their turn instead of each waiting out its own deadline."""

from __future__ import annotations

import asyncio

import pytest

from cluster.prefill_client import PassedOver, WorkerTurns


async def _take(turns: WorkerTurns, index: int, log: list[str], name: str) -> None:
    try:
        async with turns.turn(index):
            log.append(f"{name} ran")
            await asyncio.sleep(0)
    except PassedOver:
        log.append(f"{name} passed over")


def test_prompts_take_a_worker_one_at_a_time_in_order() -> None:
    async def main() -> list[str]:
        turns, log = WorkerTurns(1), list[str]()
        await asyncio.gather(*(_take(turns, 0, log, n) for n in "abc"))
        return log

    assert asyncio.run(main()) == ["a ran", "b ran", "c ran"]


def test_prompts_queued_for_a_worker_passed_over_give_it_up_and_others_do_not() -> None:
    async def main() -> list[str]:
        turns, log = WorkerTurns(2), list[str]()
        held = asyncio.Event()

        async def silent() -> None:  # the prompt in flight when the worker's host went silent
            async with turns.turn(0):
                held.set()
                await asyncio.sleep(3600)

        first = asyncio.create_task(silent())
        await held.wait()
        queued = [asyncio.create_task(_take(turns, 0, log, n)) for n in "bc"]
        other = asyncio.create_task(_take(turns, 1, log, "d"))
        await asyncio.sleep(0)
        turns.pass_over(0, for_s=60.0)  # the first prompt's deadline: given up
        first.cancel()
        await asyncio.gather(*queued, other)
        with pytest.raises(asyncio.CancelledError):
            await first
        return log

    assert sorted(asyncio.run(main())) == ["b passed over", "c passed over", "d ran"]


def test_a_worker_is_taken_again_once_its_time_passed_over_is_out() -> None:
    async def main() -> list[str]:
        turns, log = WorkerTurns(1), list[str]()
        turns.pass_over(0, for_s=0.0)
        await _take(turns, 0, log, "a")
        return log

    assert asyncio.run(main()) == ["a ran"]
