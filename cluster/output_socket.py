"""An output channel over a socket of its own: a verifier's messages to a client process without
Ray's streaming call in between.

A Ray streaming generator costs each message a yield in the verifier's event loop, its
serialization on an executor thread, a report through the core worker, and on the client's side
a `ray.wait` and `ray.get` in Python: about 1 ms of CPU a message on the 2-core VM, most of a
single stream's serving cost on a host that the verifier shares with the router. Over its own
TCP connection a message is one `pickle.dumps` and one write on the verifier's event loop, and
one read and `pickle.loads` on the client's reading thread.

The verifier listens on its node's address (`OutputServer`) and hands the address, with a
secret of its own, to Ray callers only (`VerifierActor.outputs_address`): a connection that does
not open with the secret is closed unread. A connection is one client's channel: the verifier
writes each of the channel's messages as a length and a pickle (from its event loop, or, on a
CPU verifier, from the engine's thread: `DirectSender`), and when the connection closes
(the client closed it, or its process died) the channel ends and its requests are aborted, as
when a Ray stream ends. When the verifier dies, the client's stream fails with the actor's error,
as a Ray stream does: the client keeps a call in flight that the verifier answers only when the
channel ends (`VerifierActor.until_closed`), and asks it why the connection ended. A verifier
whose host is cut off closes nothing: the client's keep-alive finds it silent, as for a Ray
stream (cluster/output_reader.py). Clients that reach Ray through
Ray Client (a router pod of the chart) poll instead: the chart's network policy lets routers
reach Ray pods on the client port alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"ORO1"  # what a client's first bytes are: the protocol and its version
SECRET_BYTES = 16
_LENGTH = struct.Struct("!I")  # a message's length, before its bytes
_ID_LENGTH = struct.Struct("!H")  # the client id's length, in the opening
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not opened by then is closed
_RECV_BYTES = 1 << 16  # read at most this much a call
_LOOP_CHECK_S = 1.0  # how often a thread whose connection a loop reads sees to that loop

# An output server's address as Ray hands it to a client: host, port and the secret
Address = tuple[str, int, bytes]


class OutputServer:
    """The verifier's side: a TCP server on its event loop, a connection a client's channel.

    `opened(client)` is the client's channel (anything with `batches()`, an async iterator of
    messages, and `close()`), or None for a client whose channel has ended already;
    `dropped(client, channel)` is called once its connection ends. With `direct`, a channel
    (a `ClientChannel`) is given a `DirectSender` of its connection once what it had is sent,
    to send from other threads than the loop's."""

    def __init__(
        self,
        opened: Callable[[str], Any | None],
        dropped: Callable[[str, Any], None],
        direct: bool = False,
    ) -> None:
        self.opened, self.dropped = opened, dropped
        self.direct = direct
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._server: asyncio.Server | None = None
        self._host = ""

    async def address(self, host: str) -> Address:
        """Where clients connect (listening from the first call on, on `host`)."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host=host, port=0)
            self._host = host
        port = int(self._server.sockets[0].getsockname()[1])
        return self._host, port, self.secret

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            client = await asyncio.wait_for(self._opening(reader), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as err:
            log.warning("an output connection was refused: %s", err)
            writer.close()
            return
        channel = self.opened(client)
        if channel is None:  # its channel ended: the client's reader stops at once
            writer.close()
            return
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The client sends nothing after its opening: a read that ends is its connection's end.
        gone = asyncio.create_task(reader.read())
        gone.add_done_callback(lambda _: channel.close())
        sender = DirectSender(writer) if self.direct else None
        try:
            if sender is not None:
                channel.go_direct(sender)  # unless something waits for the stream already
            async for batch in channel.batches():
                writer.write(frame(batch))
                await writer.drain()
                if sender is not None and writer.transport.get_write_buffer_size() == 0:
                    channel.go_direct(sender)  # all sent: the next goes direct
        except (ConnectionError, OSError) as err:
            log.info("the output connection of client %s broke: %s", client, err)
        finally:
            gone.cancel()
            if sender is not None:
                channel.leave_direct()
                sender.close()
            self.dropped(client, channel)
            writer.close()

    async def _opening(self, reader: asyncio.StreamReader) -> str:
        head = await reader.readexactly(len(MAGIC) + SECRET_BYTES + _ID_LENGTH.size)
        magic, secret = head[: len(MAGIC)], head[len(MAGIC) : len(MAGIC) + SECRET_BYTES]
        if magic != MAGIC:
            raise ValueError("not an output channel's opening")
        if not hmac.compare_digest(secret, self.secret):
            raise ValueError("a wrong secret")
        (length,) = _ID_LENGTH.unpack(head[-_ID_LENGTH.size :])
        return (await reader.readexactly(length)).decode()


def frame(message: Any) -> bytes:
    """A message as the connection carries it: its length, then its pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class DirectSender:
    """Sends a connection's messages from any thread (a CPU verifier's engine thread, once a
    step), straight to its socket, instead of waking its event loop to write them: the wake-up
    and the hand-off of the interpreter lock between the threads cost more than the write.
    What the socket does not take at once (a client that reads slowly) goes to the loop's
    writer, and the sender is `congested` from then on: its channel writes through the loop
    again, in order after it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        fd = writer.get_extra_info("socket").fileno()
        self._sock = socket.socket(fileno=os.dup(fd))  # the same connection, a handle of its own
        self._sock.setblocking(False)  # as the loop keeps it: a full socket never waits
        self.congested = False

    def send(self, message: Any) -> bool:
        """Send `message` (its rest through the loop, where the socket is full); False once
        congested (or the connection broke: its end closes the channel)."""
        if self.congested:
            raise RuntimeError("a congested sender sends nothing more")
        data = memoryview(frame(message))
        sent = 0
        try:
            while sent < len(data):
                sent += self._sock.send(data[sent:])
        except BlockingIOError:
            pass
        except OSError as err:
            log.info("a direct send failed: %s", err)
            self.congested = True
            return False
        if sent < len(data):
            self.congested = True
            with contextlib.suppress(RuntimeError):  # a closed loop: the connection is gone
                self._loop.call_soon_threadsafe(self._writer.write, bytes(data[sent:]))
        return not self.congested

    def close(self) -> None:
        self._sock.close()


class OutputConnection:
    """The client's side: one connection to a verifier's output server, read on one thread, or
    on an event loop (`read`) where the messages' readers wait."""

    def __init__(self, address: Address, client: str, timeout_s: float) -> None:
        host, port, secret = address
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(None)  # reads wait: silence is the keep-alive's to judge
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = client.encode()
        self._sock.sendall(MAGIC + secret + _ID_LENGTH.pack(len(name)) + name)
        self._frames = _Frames()
        self._lock = threading.Lock()
        self._on_loop: asyncio.AbstractEventLoop | None = None  # the loop reading it, if one
        self._closing = False

    def batches(self) -> Iterator[Any]:
        """Each message, read on this thread, until the verifier closes the connection (or
        `close`)."""
        while data := self._recv():
            yield from self._frames.feed(data)

    def read(self, hand_out: Callable[[Any], None], loop: asyncio.AbstractEventLoop | None) -> None:
        """Hand each message to `hand_out` until the connection ends. With `loop`, the
        connection is read on that event loop's thread, and `hand_out` is called there: a
        message costs that loop one wake-up and no other thread's (a reading thread's wake-up
        and its hand-off to the loop were most of a one-stream router's work). This thread waits
        meanwhile; if the loop closes first, it reads the rest itself."""
        if loop is None or not self._read_on(loop, hand_out):
            for message in self.batches():
                hand_out(message)

    def _read_on(self, loop: asyncio.AbstractEventLoop, hand_out: Callable[[Any], None]) -> bool:
        """`read` on `loop`: False when the loop closed before the connection ended (what it
        had read is handed out; the rest is this thread's to read)."""
        ended = threading.Event()
        failure: list[BaseException] = []
        fd = self._sock.fileno()

        def readable() -> None:
            try:
                data = self._recv()
            except (BlockingIOError, InterruptedError):  # nothing after all
                return
            try:
                for message in self._frames.feed(data):
                    hand_out(message)
            except BaseException as exc:  # raised in the waiting thread, as a reading thread's
                failure.append(exc)
                data = b""
            if not data:
                loop.remove_reader(fd)
                ended.set()

        def start() -> None:
            try:
                self._sock.setblocking(False)
                loop.add_reader(fd, readable)
            except (OSError, ValueError):  # closed meanwhile
                ended.set()

        with self._lock:
            if self._closing:
                return True
            try:
                loop.call_soon_threadsafe(start)
            except RuntimeError:  # a closed loop
                return False
            self._on_loop = loop
        try:
            while not ended.wait(_LOOP_CHECK_S):
                if loop.is_closed():  # its selector went with it: nothing watches the socket
                    self._sock.setblocking(True)
                    return False
                if self._closing and not loop.is_running():  # nobody will see the end there
                    return True
        finally:
            with self._lock:
                self._on_loop = None
                if self._closing:
                    self._sock.close()
        if failure:
            raise failure[0]
        return True

    def _recv(self) -> bytes:
        """What the socket has (b"": the connection ended)."""
        try:
            return self._sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):  # a socket a loop reads: nothing yet
            raise
        except OSError:
            return b""

    def close(self) -> None:
        """End the connection; its reader (a thread, or a loop) stops."""
        with self._lock:
            self._closing = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            # On a loop, the socket is closed once the loop has stopped watching it (a number
            # closed under the loop's selector could come back as another socket's).
            if self._on_loop is None:
                self._sock.close()


class _Frames:
    """Messages out of a byte stream: each a length and a pickle."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """The messages `data` completes."""
        buffer = self._buffer
        buffer += data
        messages, start = [], 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + length
            if len(buffer) < end:
                break
            messages.append(pickle.loads(buffer[start + _LENGTH.size : end]))
            start = end
        del buffer[:start]
        return messages
