"""Step channels between a verifier and a drafter (threads here; actors in test_runtime.py):
answers in order, a late answer dropped before the awaited one, a handler's exception as a
`Failure`, partial frames kept across timeouts, and no request handled from a connection without
the current token."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from cluster.step_channel import (
    HEADER,
    ChannelError,
    ChannelTimeout,
    Failure,
    StepClient,
    StepServer,
    _Frames,
)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_requests_are_answered_in_order_with_tensors() -> None:
    server = StepServer(lambda x: {"doubled": x * 2})
    client = StepClient(server.address())
    try:
        sent = [torch.arange(4) + i for i in range(3)]
        seqs = [client.request(t) for t in sent]
        for seq, tensor in zip(seqs, sent, strict=True):
            assert torch.equal(client.reply(seq, soon())["doubled"], tensor * 2)
    finally:
        client.close()
        server.close()


def test_a_late_reply_is_dropped_before_the_awaited_one() -> None:
    release = threading.Event()

    def handle(x: int) -> int:
        if x == 0:
            release.wait(5)
        return x + 100

    server = StepServer(handle)
    client = StepClient(server.address())
    try:
        first = client.request(0)
        with pytest.raises(ChannelTimeout):
            client.reply(first, soon(0.05))
        second = client.request(1)
        release.set()
        assert client.reply(second, soon()) == 101  # the first's 100 came first and went
    finally:
        client.close()
        server.close()


def test_a_handler_exception_is_a_failure_and_the_channel_goes_on() -> None:
    def handle(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x

    server = StepServer(handle)
    client = StepClient(server.address())
    try:
        failed = client.reply(client.request(-1), soon())
        assert failed == Failure("ValueError", "negative")
        assert client.reply(client.request(7), soon()) == 7
    finally:
        client.close()
        server.close()


def test_a_connection_without_the_token_is_refused_and_never_handled() -> None:
    handled: list[object] = []
    server = StepServer(handled.append)
    try:
        address = server.address()
        intruder = StepClient(type(address)(address.host, address.port, "0" * len(address.token)))
        intruder.request("payload")
        with pytest.raises(ChannelError):
            intruder.reply(0, soon())  # closed on it
        # The token still works for its owner, once.
        owner = StepClient(address)
        assert owner.reply(owner.request("mine"), soon()) is None
        assert handled == ["mine"]
        reuse = StepClient(address)
        with pytest.raises(ChannelError):
            reuse.reply(reuse.request("again"), soon())
        assert handled == ["mine"]
    finally:
        server.close()


def test_a_new_connection_replaces_the_old_one() -> None:
    server = StepServer(lambda x: x)
    old = StepClient(server.address())
    try:
        assert old.reply(old.request(1), soon()) == 1
        new = StepClient(server.address())
        assert new.reply(new.request(2), soon()) == 2
        with pytest.raises(ChannelError):
            old.reply(old.request(3), soon())
        new.close()
    finally:
        old.close()
        server.close()


def test_a_closed_server_is_a_channel_error_not_a_wait() -> None:
    server = StepServer(lambda x: x)
    client = StepClient(server.address())
    assert client.reply(client.request(1), soon()) == 1
    server.close()
    start = time.monotonic()
    with pytest.raises(ChannelError):
        client.reply(client.request(2), soon(10))
    assert time.monotonic() - start < 5


def test_a_partial_frame_survives_a_timeout() -> None:
    a, b = socket.socketpair()
    reader = _Frames(a)
    payload = b"x" * 1000
    frame = HEADER.pack(len(payload)) + payload
    b.sendall(frame[:500])
    with pytest.raises(ChannelTimeout):
        reader.recv(soon(0.05))
    b.sendall(frame[500:])
    assert reader.recv(soon()) == payload
    a.close()
    b.close()


def test_an_oversized_frame_is_refused() -> None:
    a, b = socket.socketpair()
    b.sendall(HEADER.pack(1 << 40))
    with pytest.raises(ChannelError):
        _Frames(a).recv(soon(), max_size=1 << 20)
    a.close()
    b.close()


def test_a_send_after_a_polling_receive_still_blocks_until_sent() -> None:
    """A receive with a past deadline leaves the socket non-blocking; a frame larger than the
    socket's buffers must still go whole."""
    release = threading.Event()

    def handle(data: bytes) -> int:
        release.wait(5)
        return len(data)

    server = StepServer(handle)
    client = StepClient(server.address())
    try:
        with pytest.raises(ChannelTimeout):
            client.reply(client.request(b""), time.monotonic())
        # The server reads nothing until released, so the frame fills the socket's buffers.
        threading.Timer(0.2, release.set).start()
        big = b"x" * (64 << 20)
        assert client.reply(client.request(big), soon()) == len(big)
    finally:
        client.close()
        server.close()
