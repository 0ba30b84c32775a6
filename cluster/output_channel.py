"""Output channels: a verifier's requests' outputs to a client process, one stream for all.

A Ray streaming generator a request would cost the verifier and the client ~0.3 ms an output on
the 2-core VM (a yield each: the object, the report to the caller, the caller's wake-up): at
64 requests decoding together that is more than a CPU step's host work, and on a GPU several
times a step. A client process (a router, `outrider generate`) instead opens one stream a
verifier group (`VerifierActor.outputs`, with an id of its own), and starts each request with an
ordinary call (`VerifierActor.start`, its outputs to go to that id). The verifier gathers the
outputs of all that client's requests between the client's reads (`ClientChannel`: the engine
loop hands a step's outputs over at once) and yields them as one list: one yield a step, not
one a request (tests/benchmarks/bench_output_channel.py measures both).

The stream is a TCP connection of its own to the verifier (cluster/output_socket.py: a Ray
streaming call cost about 1 ms of CPU a message), or a Ray streaming call where the client reaches
Ray through Ray Client (a poll a message there) or cannot connect to the verifier's host. The
client's side, which reads it and hands each request its outputs, is cluster/output_reader.py.
When the stream breaks (the verifier died or restarted), every request that was waiting on it
fails with the error, and the group's next request opens a new stream; a verifier that stops
answering (its host cut off: nothing is closed) breaks it too, after `silent_after_s` (the
router's `router.deadlines`). When a client's stream ends the verifier aborts that client's
requests: when the client closes it, or when the client has not said it is alive for
`CLIENT_TIMEOUT_S` (it does every `KEEP_ALIVE_S`, from a thread of its own): Ray does not end a
streaming generator whose caller died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cluster.output_socket import DirectSender
from workers.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
KEEP_ALIVE_S = 5.0  # how often a client tells each verifier it reads from that it is alive
CLIENT_TIMEOUT_S = 30.0  # a client silent this long is gone: its stream ends, its requests too
POLL_WAIT_S = 1.0  # through Ray Client: how long one poll waits on the verifier for outputs


@dataclass(frozen=True, slots=True)
class ServedBy:
    """The actors that served a request."""

    prefill: str | None  # None: the verifier prefilled it itself
    verifier: list[str]  # the group's ranks
    drafter: str | None  # None: drafted in-process (model-free methods) or not at all


@dataclass(frozen=True, slots=True)
class StreamedStep:
    """Verifier -> client: what one engine step produced for one request."""

    output: RequestOutput
    served_by: ServedBy | None = None  # with the last step


# One message of a channel: each request's item, a step's worth (an exception: the engine
# refused or failed the request)
Batch = list[tuple[str, StreamedStep | Exception]]


@dataclass(slots=True)
class ClientChannel:
    """The verifier's side: one client's outputs, gathered until its stream takes them.

    Made on the verifier's event loop, where its stream reads it. Outputs put there wake the
    stream at once; outputs put on another thread (a CPU verifier's engine thread) are sent by
    `hand_over`, once for all of a step's: straight to the client's connection where its
    stream made it `direct` (cluster/output_socket.py), else by waking the stream."""

    requests: set[str] = field(default_factory=set)  # started and not yet ended
    seen: float = field(default_factory=time.monotonic)  # when the client last said it is alive
    _items: Batch = field(default_factory=list)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: asyncio.Event = field(default_factory=asyncio.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    _loop_thread: int = field(default_factory=threading.get_ident)
    _direct: DirectSender | None = None  # while it writes the connection from any thread

    def put(self, request_id: str, item: StreamedStep | Exception) -> None:
        with self._lock:
            self._items.append((request_id, item))
        if threading.get_ident() == self._loop_thread:
            self.hand_over()

    def hand_over(self) -> None:
        """Send what was put (from any thread): over the direct connection, else through the
        stream (a wake-up of the event loop, unless this is its thread)."""
        with self._lock:
            if not self._items:
                return
            if self._direct is not None:
                items, self._items = self._items, []
                if not self._direct.send(items):  # from now on through the stream
                    self._direct = None
                return
        if threading.get_ident() == self._loop_thread:
            self._ready.set()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads any more
                self._loop.call_soon_threadsafe(self._ready.set)

    def go_direct(self, sender: DirectSender) -> bool:
        """On the event loop, with the stream's writes all sent: what is handed over from now
        on goes through `sender`. False while the stream still has something to take first."""
        with self._lock:
            if self._items or sender.congested:
                return False
            self._direct = sender
            return True

    def leave_direct(self) -> None:
        with self._lock:
            self._direct = None

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def close(self) -> None:
        """End the stream (its client is gone)."""
        self._closed.set()
        self._ready.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def batches(self) -> AsyncIterator[Batch]:
        """Everything put since the last batch, as soon as there is something; until closed."""
        while (items := await self.take()) is not None:
            if items:
                yield items

    async def take(self, wait_s: float | None = None) -> Batch | None:
        """Everything put since the last take, once there is something or `wait_s` has passed
        (then possibly nothing); None once closed."""
        if not self._ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), wait_s)
        if self.closed:
            return None
        self._ready.clear()
        with self._lock:
            items, self._items = self._items, []
        return items


async def close_silent(
    channels: dict[str, ClientChannel], on_close: Callable[[str, ClientChannel], None]
) -> None:
    """Close, from now on, the channels whose clients stopped saying they are alive, and hand
    each to `on_close` (a polled channel has no stream whose end would)."""
    while True:
        await asyncio.sleep(KEEP_ALIVE_S)
        now = time.monotonic()
        for client, channel in list(channels.items()):
            if not channel.closed and now - channel.seen > CLIENT_TIMEOUT_S:
                log.warning("client %s is gone; its requests end", client)
                channel.close()
                on_close(client, channel)
