"""Output channels' pieces without Ray (cluster/output_channel.py and output_reader.py): a
verifier's channel gathers a client's outputs into one message and ends when the client goes
silent; a request's inbox hands its items to a thread or an event loop. The Ray path is in
tests/cluster/test_runtime.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster import output_channel
from cluster.output_channel import ClientChannel, StreamedStep, close_silent
from cluster.output_reader import Inbox
from workers.engine.outputs import RequestOutput
from workers.engine.sequence import SpecStats


def _step(request_id: str, token: int) -> StreamedStep:
    return StreamedStep(RequestOutput(request_id, [token], "", False, None, 3, 1, SpecStats()))


def test_a_channel_sends_what_gathered_since_its_last_message_at_once() -> None:
    async def run() -> list[list[str]]:
        channel = ClientChannel()
        batches = channel.batches()
        for i in range(3):  # a step's outputs, before the stream reads
            channel.put(f"r{i}", _step(f"r{i}", i))
        first = await anext(batches)
        channel.put("r0", ValueError("refused"))
        second = await anext(batches)
        return [[rid for rid, _ in first], [rid for rid, _ in second]]

    assert asyncio.run(run()) == [["r0", "r1", "r2"], ["r0"]]


def test_a_polled_channel_answers_at_once_with_what_waits_else_after_the_wait() -> None:
    async def run() -> tuple[object, ...]:
        channel = ClientChannel()
        channel.put("r0", _step("r0", 1))
        ready = await channel.take(10.0)  # something waits: no wait
        started = time.monotonic()
        empty = await channel.take(0.05)
        waited = time.monotonic() - started
        later = asyncio.get_running_loop().call_later(0.02, channel.put, "r1", _step("r1", 2))
        woken = await channel.take(10.0)  # woken by the put, not the wait's end
        later.cancel()
        channel.close()
        return (
            [r for r, _ in ready or []],
            empty,
            waited >= 0.04,
            [r for r, _ in woken or []],
            (await channel.take(10.0)),
        )

    assert asyncio.run(run()) == (["r0"], [], True, ["r1"], None)


def test_a_silent_clients_channel_is_closed_and_its_stream_ends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(output_channel, "KEEP_ALIVE_S", 0.01)
    monkeypatch.setattr(output_channel, "CLIENT_TIMEOUT_S", 0.05)

    dropped: list[str] = []

    async def run() -> tuple[bool, bool, list[object]]:
        silent, alive = ClientChannel(), ClientChannel()
        channels = {"silent": silent, "alive": alive}
        closing = asyncio.create_task(close_silent(channels, lambda c, _: dropped.append(c)))
        for _ in range(20):  # the live client says so; the other says nothing
            alive.seen = time.monotonic()
            await asyncio.sleep(0.01)
        closing.cancel()
        ended = [batch async for batch in silent.batches()]  # returns: no message waits
        return silent.closed, alive.closed, ended

    assert asyncio.run(run()) == (True, False, [])
    assert dropped == ["silent"]  # handed on once: a polled channel has no stream to end
    assert [r.getMessage() for r in caplog.records] == ["client silent is gone; its requests end"]


def test_an_inbox_hands_items_to_a_thread_and_to_an_event_loop() -> None:
    inbox = Inbox()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(inbox.get() for _ in range(2)))
    reader.start()
    assert inbox.put(_step("r", 1)) is None  # no event loop waits on it
    inbox.put(None)
    reader.join(5)
    assert isinstance(got[0], StreamedStep) and got[1] is None

    async def read() -> object:
        loop = asyncio.get_running_loop()
        reading = asyncio.ensure_future(inbox.get_async())
        await asyncio.sleep(0)  # it waits now
        woken = await loop.run_in_executor(None, inbox.put, _step("r", 2))
        assert woken is loop
        loop.call_soon(inbox.wake)  # what the stream's thread has the loop do
        return await asyncio.wait_for(reading, 5)

    item = asyncio.run(read())
    assert isinstance(item, StreamedStep) and item.output.new_token_ids == [2]
