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
writes each of the channel's messages as a length and a pickle, and when the connection closes
(the client closed it, or its process died) the channel ends and its requests are aborted, as
when a Ray stream ends. When the verifier dies, the client's stream fails with the actor's error,
as a Ray stream does: the client keeps a call in flight that the verifier answers only when the
channel ends (`VerifierActor.until_closed`), and asks it why the connection ended. A verifier
whose host is cut off closes nothing: the client's keep-alive finds it silent, as for a Ray
stream (cluster/output_channel.py). Clients that reach Ray through
Ray Client (a router pod of the chart) poll instead: the chart's network policy lets routers
reach Ray pods on the client port alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

MAGIC = b"ORO1"  # what a client's first bytes are: the protocol and its version
SECRET_BYTES = 16
_LENGTH = struct.Struct("!I")  # a message's length, before its bytes
_ID_LENGTH = struct.Struct("!H")  # the client id's length, in the opening
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not opened by then is closed

# An output server's address as Ray hands it to a client: host, port and the secret
Address = tuple[str, int, bytes]


class OutputServer:
    """The verifier's side: a TCP server on its event loop, a connection a client's channel.

    `opened(client)` is the client's channel (anything with `batches()`, an async iterator of
    messages, and `close()`), or None for a client whose channel has ended already;
    `dropped(client, channel)` is called once its connection ends."""

    def __init__(
        self, opened: Callable[[str], Any | None], dropped: Callable[[str, Any], None]
    ) -> None:
        self.opened, self.dropped = opened, dropped
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
        try:
            async for batch in channel.batches():
                body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                writer.write(_LENGTH.pack(len(body)) + body)
                await writer.drain()
        except (ConnectionError, OSError) as err:
            log.info("the output connection of client %s broke: %s", client, err)
        finally:
            gone.cancel()
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


class OutputConnection:
    """The client's side: one connection to a verifier's output server, read on one thread."""

    def __init__(self, address: Address, client: str, timeout_s: float) -> None:
        host, port, secret = address
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.settimeout(None)  # reads wait: silence is the keep-alive's to judge
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = client.encode()
        self._sock.sendall(MAGIC + secret + _ID_LENGTH.pack(len(name)) + name)
        self._file: BinaryIO = self._sock.makefile("rb")

    def batches(self) -> Iterator[Any]:
        """Each message, until the verifier closes the connection (or `close`)."""
        while True:
            head = self._file.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return
            (length,) = _LENGTH.unpack(head)
            body = self._file.read(length)
            if len(body) < length:
                return
            yield pickle.loads(body)

    def close(self) -> None:
        """End the connection; a thread reading it stops."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
