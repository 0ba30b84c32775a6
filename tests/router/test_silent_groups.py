"""A verifier group that stops answering (its host cut off: Ray gives its node up only after
tens of seconds) costs routing one bounded wait, then gets no requests while another group
answers; a request already sent to it is failed by its channel, not left waiting on the call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import pytest

from cluster.output_reader import Inbox
from cluster.runtime import RequestStream
from router.backends import RuntimeBackend
from router.routing import GroupChooser, RoutingPolicy
from workers.engine.engine_loop import LoopLoad


class Call:
    """What `.remote()` returns, answered now (`value`) or never."""

    def __init__(self, value: Any = None, answers: bool = True) -> None:
        self._future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if answers:
            self._future.set_result(value)

    def future(self) -> concurrent.futures.Future[Any]:
        return self._future


class Method:
    def __init__(self, answers: bool, value: Any) -> None:
        self.answers, self.value, self.calls = answers, value, 0

    def remote(self, *args: Any) -> Call:
        self.calls += 1
        return Call(self.value, self.answers)


class Verifier:
    def __init__(self, answers: bool, depth: int) -> None:
        self.load = Method(answers, LoopLoad(depth, 0, 0.1))
        self.info = Method(answers, {"pid": 1})


class Pools:
    def __init__(self, verifiers: list[Verifier]) -> None:
        self.verifiers = verifiers
        self.verifier_names = [f"g{i}" for i in range(len(verifiers))]


class Runtime:
    def __init__(self, verifiers: list[Verifier]) -> None:
        self.pools = Pools(verifiers)


def test_a_silent_group_is_waited_for_once_then_not_until_it_answers() -> None:
    quick = 0.2
    silent, busy = Verifier(answers=False, depth=0), Verifier(answers=True, depth=50)
    backend = RuntimeBackend(Runtime([silent, busy]), answer_within_s=quick)

    async def scenario() -> list[tuple[float, list[LoopLoad | None]]]:
        timed = []
        for _ in range(3):
            t0 = time.perf_counter()
            loads = await backend.load()
            timed.append((time.perf_counter() - t0, loads))
        assert not await backend.healthy(0) and await backend.healthy(1)
        assert not await backend.ready()
        return timed

    timed = asyncio.run(scenario())
    assert timed[0][0] >= quick and [load is None for load in timed[0][1]] == [True, False]
    assert all(seconds < quick / 2 for seconds, _ in timed[1:])  # not waited for again
    assert all(loads[0] is None and loads[1] is not None for _, loads in timed)
    assert silent.load.calls == 1 and busy.load.calls == 3  # its one poll is still out


class Loads:
    def __init__(self, loads: list[LoopLoad | None]) -> None:
        self.loads = loads
        self.groups = [f"g{i}" for i in range(len(loads))]

    async def load(self) -> list[LoopLoad | None]:
        return self.loads


class Metric:
    def labels(self, *names: str) -> Metric:
        return self

    def set(self, value: float) -> None:
        pass


class Metrics:
    queue_depth = kv_usage = Metric()


class NoRedis:
    up = False


def _choices(loads: list[LoopLoad | None], n: int = 40) -> list[int]:
    chooser = GroupChooser(Loads(loads), None, NoRedis(), Metrics(), 16, RoutingPolicy(seed=1))  # type: ignore[arg-type]

    async def picks() -> list[int]:
        return [(await chooser.choose([1, 2, 3]))[0] for _ in range(n)]

    return asyncio.run(picks())


def test_routing_sends_a_group_that_did_not_answer_nothing_while_another_does() -> None:
    busy = LoopLoad(60, 0, 0.9)
    assert set(_choices([None, busy, None])) == {1}
    assert set(_choices([None, None])) == {0, 1}  # none answers: any (it fails over later)


def test_a_request_whose_start_is_never_answered_fails_with_its_channel() -> None:
    async def scenario() -> None:
        inbox = Inbox()
        channel = type("Channel", (), {"forget": lambda self, request_id: None})()
        stream = RequestStream("r", "g0", Call(answers=False), inbox, channel)

        def channel_gives_up() -> None:
            inbox.put(ConnectionError("silent"))
            inbox.wake()

        asyncio.get_running_loop().call_later(0.05, channel_gives_up)
        with pytest.raises(ConnectionError, match="silent"):
            await asyncio.wait_for(anext(stream.items_async()), 5.0)

    asyncio.run(scenario())
