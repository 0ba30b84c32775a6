"""An output channel over a connection of its own (cluster/output_socket.py), without Ray: a
verifier's server on an event loop, a client's connection read on this thread. Through Ray (the
verifier actor, the router's `GroupOutputs`) it is in tests/cluster/test_runtime.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.output_channel import ClientChannel, StreamedStep
from cluster.output_socket import Address, OutputConnection, OutputServer
from workers.engine.outputs import RequestOutput
from workers.engine.sequence import SpecStats


def _step(request_id: str, token: int) -> StreamedStep:
    return StreamedStep(RequestOutput(request_id, [token], "", False, None, 3, 1, SpecStats()))


class Verifier:
    """An output server on an event loop of its own thread, its clients' channels kept as a
    verifier keeps them."""

    def __init__(self, direct: bool = False) -> None:
        self.channels: dict[str, ClientChannel] = {}
        self.dropped: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = OutputServer(self._opened, self._dropped, direct)
        self.address: Address = self.call(self.server.address("127.0.0.1"))

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def put(self, client: str, request_id: str, item: Any) -> None:
        async def put() -> None:
            self.channels.setdefault(client, ClientChannel()).put(request_id, item)

        self.call(put())

    def _opened(self, client: str) -> ClientChannel | None:
        if client in self.dropped:
            return None
        return self.channels.setdefault(client, ClientChannel())

    def _dropped(self, client: str, channel: ClientChannel) -> None:
        self.dropped.append(client)

    def close(self) -> None:
        async def closed() -> None:
            for channel in self.channels.values():  # each connection's writer ends
                channel.close()
            self.server.close()
            await asyncio.sleep(0.05)

        self.call(closed())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture
def verifier() -> Iterator[Verifier]:
    v = Verifier()
    yield v
    v.close()


def _eventually(check: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_connection_reads_its_clients_messages_in_order(verifier: Verifier) -> None:
    verifier.put("c1", "r0", _step("r0", 1))  # before the client connects: kept for it
    connection = OutputConnection(verifier.address, "c1", timeout_s=5)
    batches = connection.batches()
    first = next(batches)
    verifier.put("c2", "other", _step("other", 9))  # another client's: not on this connection
    verifier.put("c1", "r1", _step("r1", 2))
    verifier.put("c1", "r0", ValueError("refused"))
    later = [next(batches)]
    if len(later[0]) < 2:  # the two puts may cross as one message or two
        later.append(next(batches))
    batches.close()
    connection.close()
    assert [(rid, item.output.new_token_ids) for rid, item in first] == [("r0", [1])]
    items = [pair for batch in later for pair in batch]
    assert [rid for rid, _ in items] == ["r1", "r0"]
    assert isinstance(items[1][1], ValueError) and str(items[1][1]) == "refused"


def test_a_client_that_closes_ends_its_channel(verifier: Verifier) -> None:
    connection = OutputConnection(verifier.address, "leaving", timeout_s=5)
    verifier.put("leaving", "r0", _step("r0", 1))
    next(connection.batches())
    connection.close()
    assert _eventually(lambda: verifier.dropped == ["leaving"])
    assert verifier.channels["leaving"].closed
    # Its id does not open a channel again: a reader that comes back gets nothing.
    again = OutputConnection(verifier.address, "leaving", timeout_s=5)
    assert list(again.batches()) == []


def test_a_connection_without_the_secret_is_closed_unread(verifier: Verifier) -> None:
    host, port, secret = verifier.address
    verifier.put("c1", "r0", _step("r0", 1))
    wrong = bytes(b ^ 0xFF for b in secret)
    connection = OutputConnection((host, port, wrong), "c1", timeout_s=5)
    assert list(connection.batches()) == []  # closed by the verifier, nothing sent
    assert verifier.dropped == []  # the client's channel is untouched


def test_closing_a_connection_stops_the_thread_reading_it(verifier: Verifier) -> None:
    connection = OutputConnection(verifier.address, "c1", timeout_s=5)
    read: list[Any] = []
    reader = threading.Thread(target=lambda: read.extend(connection.batches()), daemon=True)
    reader.start()
    time.sleep(0.1)  # the reader waits on a silent verifier
    connection.close()
    reader.join(5)
    assert not reader.is_alive() and read == []


class ClientLoop:
    """A client's event loop on a thread of its own (the router's), and what was handed out on
    it, with the thread each message was handed out on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.got: list[tuple[Any, threading.Thread]] = []

    def hand_out(self, batch: Any) -> None:
        self.got.append((batch, threading.current_thread()))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _read_in_background(connection: OutputConnection, client: ClientLoop) -> threading.Thread:
    reader = threading.Thread(
        target=connection.read, args=(client.hand_out, client.loop), daemon=True
    )
    reader.start()
    return reader


def test_a_connection_read_on_an_event_loop_hands_out_there_in_order(verifier: Verifier) -> None:
    client = ClientLoop()
    connection = OutputConnection(verifier.address, "c1", timeout_s=5)
    reader = _read_in_background(connection, client)
    for token in range(20):
        verifier.put("c1", "r0", _step("r0", token))
    assert _eventually(lambda: sum(len(batch) for batch, _ in client.got) == 20)
    tokens = [item.output.new_token_ids[0] for batch, _ in client.got for _, item in batch]
    assert tokens == list(range(20))
    assert {thread for _, thread in client.got} == {client.thread}  # the loop's, no other
    connection.close()  # the loop stops watching it, and the waiting thread returns
    reader.join(5)
    assert not reader.is_alive()
    assert _eventually(lambda: verifier.dropped == ["c1"])
    client.close()


def test_a_connection_whose_loop_closes_is_read_on_by_its_thread(verifier: Verifier) -> None:
    client = ClientLoop()
    connection = OutputConnection(verifier.address, "c1", timeout_s=5)
    reader = _read_in_background(connection, client)
    verifier.put("c1", "r0", _step("r0", 1))
    assert _eventually(lambda: len(client.got) == 1)
    client.close()
    verifier.put("c1", "r0", _step("r0", 2))  # after the loop: the thread reads it
    assert _eventually(lambda: len(client.got) == 2)
    assert client.got[1][1] is reader

    async def end() -> None:  # the verifier ends the channel: the thread's read returns
        verifier.channels["c1"].close()

    verifier.call(end())
    reader.join(5)
    assert not reader.is_alive()


def test_a_hand_out_that_fails_ends_the_read_with_its_error(verifier: Verifier) -> None:
    client = ClientLoop()
    connection = OutputConnection(verifier.address, "c1", timeout_s=5)

    def broken(batch: Any) -> None:
        raise KeyError("a bug")

    verifier.put("c1", "r0", _step("r0", 1))
    with pytest.raises(KeyError, match="a bug"):
        connection.read(broken, client.loop)
    client.close()


def _tokens(batches: Any) -> list[int]:
    return [item.output.new_token_ids[0] for batch in batches for _, item in batch]


@pytest.fixture
def direct_verifier() -> Iterator[Verifier]:
    v = Verifier(direct=True)
    yield v
    v.close()


def test_a_direct_channel_is_sent_from_another_thread_in_order(direct_verifier: Verifier) -> None:
    """What waited for the client goes first through the loop; then a step's outputs, put and
    handed over on another thread (the engine's), go straight to the connection, one message a
    hand-over."""
    v = direct_verifier
    v.put("c1", "r0", _step("r0", 0))  # before the client connects
    connection = OutputConnection(v.address, "c1", timeout_s=5)
    batches = connection.batches()
    assert _tokens([next(batches)]) == [0]
    assert _eventually(lambda: v.channels["c1"].direct)
    channel = v.channels["c1"]
    for step in range(1, 6):  # on this thread, as the engine's
        channel.put("r0", _step("r0", 2 * step - 1))
        channel.put("r1", _step("r1", 2 * step))
        channel.hand_over()
    got = [next(batches) for _ in range(5)]
    assert [len(batch) for batch in got] == [2] * 5
    assert _tokens(got) == list(range(1, 11))
    connection.close()
    assert _eventually(lambda: v.dropped == ["c1"])
    assert not channel.direct


def test_a_client_too_slow_for_direct_sends_gets_the_rest_through_the_loop(
    direct_verifier: Verifier,
) -> None:
    v = direct_verifier
    connection = OutputConnection(v.address, "c1", timeout_s=5)
    assert _eventually(lambda: "c1" in v.channels and v.channels["c1"].direct)
    channel = v.channels["c1"]
    big = "x" * 200_000  # a message more than the socket buffers hold unread
    for token in range(40):  # the client reads nothing meanwhile
        output = RequestOutput("r0", [token], big, False, None, 3, 1, SpecStats())
        channel.put("r0", StreamedStep(output))
        channel.hand_over()
    assert not channel.direct  # congested: the loop writes what is left, in order
    tokens: list[int] = []
    batches = connection.batches()
    while len(tokens) < 40:  # the loop gathers what waited for it into fewer messages
        tokens += _tokens([next(batches)])
    assert tokens == list(range(40))
    connection.close()
