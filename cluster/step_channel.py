"""Step channels: the verifier's per-step messages to a drafter actor over one TCP connection.

A Ray actor call costs ~1 ms on an idle machine and 2-3 ms on a busy one (the caller's core
worker, gRPC, the callee's task queue and execution thread, and back); a verifier pays it on
every engine step, for each drafter it waits on. A step channel is one connection the verifier
keeps open to its drafter: a step is a frame out and a frame back, and the drafter's serving
thread is already waiting on the socket.

The drafter listens on its node's address; the verifier learns the address and a one-time token
through an ordinary (authenticated) Ray call, and the first frame it sends must be that token:
nothing from a connection is unpickled before it has proved it came from that call. A new
authenticated connection replaces the previous one (the verifier reconnected).

Frames are `[8-byte length][pickle of (sequence number, payload)]`. Requests and replies carry
the same sequence number, so a caller that stopped waiting for a late reply (its deadline
passed) drops it when it comes, before the reply it is waiting for; the server answers strictly
in order. Plain data and tensors only cross: the caller's messages are dataclasses of lists,
strings and numbers, the replies tokens and draft probabilities. Feature rows keep travelling
over the pair's `TensorLink`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.links import node_address

HEADER = struct.Struct("!Q")
MAX_FRAME_BYTES = 1 << 30
TOKEN_BYTES = 16  # hex-encoded in the first frame
CONNECT_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """The channel broke (the peer closed it, died, or sent something that is not a frame)."""


class ChannelTimeout(TimeoutError):
    """No reply by the deadline; the channel stays usable (the late reply is dropped later)."""


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """What the verifier needs to connect: plain data, passed in a Ray call."""

    host: str
    port: int
    token: str  # the first frame must carry it


@dataclass(frozen=True, slots=True)
class Failure:
    """A reply saying the handler raised; `kind` is the exception's class name."""

    kind: str
    message: str


class _Frames:
    """Length-prefixed frames over a socket, keeping partial input across timeouts."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame goes at once
        self.sock = sock
        self._buffer = bytearray()

    def send(self, payload: bytes) -> None:
        # Blocking, whatever timeout the last receive left; a peer that takes nothing for
        # this long is as good as gone (and a frame cut off in the middle breaks the channel).
        self.sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            self.sock.sendall(HEADER.pack(len(payload)) + payload)
        except OSError as err:
            raise ChannelError(f"send failed: {err}") from err

    def recv(self, deadline: float | None, max_size: int = MAX_FRAME_BYTES) -> bytes:
        """The next frame; ChannelTimeout at `deadline` (a `time.monotonic()` value; None:
        wait for ever; one already past: only what has arrived) with whatever arrived kept for
        the next call."""
        while True:
            if len(self._buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buffer)
                if size > max_size:
                    raise ChannelError(f"a frame of {size} bytes: not a step channel peer")
                end = HEADER.size + size
                if len(self._buffer) >= end:
                    frame = bytes(self._buffer[HEADER.size : end])
                    del self._buffer[:end]
                    return frame
            self._fill(deadline)

    def _fill(self, deadline: float | None) -> None:
        # A timeout of 0 makes the socket non-blocking: a deadline already past still takes
        # what has arrived.
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(1 << 20)
        except (TimeoutError, BlockingIOError) as err:
            raise ChannelTimeout("no reply by the deadline") from err
        except OSError as err:
            raise ChannelError(f"receive failed: {err}") from err
        if not chunk:
            raise ChannelError("the peer closed the channel")
        self._buffer += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):  # not connected (any more)
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it; close does not
        self.sock.close()


class StepServer:
    """The drafter's side: a listening socket and one serving thread for the connection of the
    latest token handed out; `handle(payload)` answers each request in order."""

    def __init__(self, handle: Callable[[Any], Any], name: str = "step-channel") -> None:
        self.handle = handle
        self.name = name
        self._listener = socket.create_server((node_address(), 0))
        self._token = ""
        self._current: _Frames | None = None
        self._lock = threading.Lock()
        # A reconnected verifier's first request may come while its old connection's thread
        # still handles the last one: requests are handled one at a time all the same.
        self._handling = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def address(self) -> ChannelAddress:
        """A fresh token for the next connection (the verifier's previous one stays until the
        new one proves itself)."""
        self._token = secrets.token_hex(TOKEN_BYTES)
        host, port = self._listener.getsockname()[:2]
        return ChannelAddress(host, port, self._token)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            if self._current is not None:
                self._current.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(_Frames(sock),), name=f"{self.name}-serve", daemon=True
            ).start()

    def _serve(self, frames: _Frames) -> None:
        try:
            token = frames.recv(time.monotonic() + CONNECT_TIMEOUT_S, 2 * TOKEN_BYTES)
            if not self._token or not hmac.compare_digest(token, self._token.encode()):
                log.warning("%s: refused a connection without the current token", self.name)
                frames.close()
                return
            self._token = ""  # one connection per token
            with self._lock:
                if self._current is not None:
                    self._current.close()  # the verifier reconnected: its old thread ends
                self._current = frames
            while True:
                seq, payload = pickle.loads(frames.recv(None))
                with self._handling:
                    try:
                        reply = self.handle(payload)
                    except Exception as err:  # the caller decides what a failure means
                        reply = Failure(type(err).__name__, str(err))
                frames.send(pickle.dumps((seq, reply), protocol=pickle.HIGHEST_PROTOCOL))
        except (ChannelError, ChannelTimeout):
            frames.close()  # the verifier went away or gave up connecting
        except Exception:  # not our frames (unpickling failed): drop the connection
            log.exception("%s: dropped a connection", self.name)
            frames.close()


class StepClient:
    """The verifier's side: `request` sends a payload and returns its sequence number;
    `reply(seq, deadline)` waits for that request's answer, dropping earlier ones."""

    def __init__(self, address: ChannelAddress, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        try:
            sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
        except OSError as err:
            where = f"{address.host}:{address.port}"
            raise ChannelError(f"could not connect to {where}: {err}") from err
        self._frames = _Frames(sock)
        self._frames.send(address.token.encode())
        self._next = 0

    def request(self, payload: Any) -> int:
        seq = self._next
        self._next += 1
        self._frames.send(pickle.dumps((seq, payload), protocol=pickle.HIGHEST_PROTOCOL))
        return seq

    def reply(self, seq: int, deadline: float | None) -> Any:
        """The answer to request `seq`: ChannelTimeout at `deadline` (one already past: unless
        it has arrived), ChannelError when the channel broke; a `Failure` when the handler
        raised."""
        while True:
            got, payload = pickle.loads(self._frames.recv(deadline))
            if got == seq:
                return payload
            if got > seq:
                raise ChannelError(f"reply {got} came before reply {seq}")
            # an earlier request's late reply: its caller stopped waiting

    def close(self) -> None:
        self._frames.close()
