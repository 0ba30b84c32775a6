"""Output channels, the client's side (cluster/output_channel.py has the protocol and the
verifier's side): `GroupOutputs` reads a client process's stream from one verifier group, and
`Inbox` hands each of its requests their items.

`GroupOutputs` opens the stream on a thread of its own: a connection of its own to the
verifier (cluster/output_socket.py), read on the event loop its requests are read on where it
was given one (the router's: one wake-up a message, no thread in between), else by that
thread; or, through Ray Client or where the verifier's host cannot be reached, a Ray streaming
call or polls, read by that thread. The thread hands each output to its request's inbox and
wakes each event loop that waits on some once a message. A keep-alive thread tells the
verifier this client is alive, and breaks the stream when the verifier stops answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from cluster.output_channel import KEEP_ALIVE_S, POLL_WAIT_S, Batch, StreamedStep
from cluster.output_socket import OutputConnection

log = logging.getLogger(__name__)


def client_id() -> str:
    """A new id for one stream of this process's (a reconnection takes another)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


# An inbox's item: a message, the exception that refused or failed its request, or None once
# its request was aborted (its reader stops)
Item = StreamedStep | BaseException | None


class Inbox:
    """One request's items on the client's side, for one reader: a thread (`get`) or an event
    loop (`get_async`)."""

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._lock = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> asyncio.AbstractEventLoop | None:
        """Add an item (from the stream's thread); the event loop to wake with `wake`, if one
        waits on this inbox."""
        with self._lock:
            self._items.append(item)
            self._lock.notify()
            waiting = self._waiter is not None and not self._waiter.done()
            return self._loop if waiting else None

    def wake(self) -> None:
        """On the waiting event loop: its reader goes on."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get(self) -> Item:
        with self._lock:
            while not self._items:
                self._lock.wait()
            return self._items.popleft()

    async def get_async(self) -> Item:
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                self._loop = asyncio.get_running_loop()
                self._waiter = self._loop.create_future()
            await self._waiter


def _wake_all(inboxes: list[Inbox]) -> None:
    for inbox in inboxes:
        inbox.wake()


class GroupOutputs:
    """The client's side: this process's stream from one verifier group, read on a thread of
    its own, and the inboxes of its requests there."""

    def __init__(
        self,
        verifier: Any,
        name: str,
        silent_after_s: float = 5.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """`silent_after_s`: a verifier with requests waiting that does not answer the
        keep-alive within this is taken for gone. `loop`: the event loop its requests are read
        on (the router's), which reads a connection's messages itself (no thread in between)."""
        self.client = client_id()
        self._loop = loop
        self.verifier, self.name = verifier, name
        self.silent_after_s = silent_after_s
        self._inboxes: dict[str, Inbox] = {}
        self._lock = threading.Lock()
        self.failure: BaseException | None = None  # what broke the stream
        self._closed = threading.Event()
        # What the stream is read from, once the reading thread has opened it
        self._generator: Any = None
        self._connection: OutputConnection | None = None
        self._watch: Any = None  # a call the verifier answers when the connection's channel ends
        self._polling = ray_client_connected()  # Ray Client: no streaming calls; polled
        self._thread = threading.Thread(target=self._read, name=f"outputs-{name}", daemon=True)
        self._thread.start()
        self._alive = threading.Thread(target=self._keep_alive, name=f"alive-{name}", daemon=True)
        self._alive.start()

    @property
    def broken(self) -> bool:
        return self.failure is not None

    @property
    def transport(self) -> str | None:
        """What the stream is read from: "connection", "ray stream", "ray polls" (None: not
        opened yet)."""
        with self._lock:
            if self._connection is not None:
                return "connection"
            if self._generator is not None:
                return "ray stream"
        return "ray polls" if self._polling else None

    def register(self, request_id: str) -> Inbox:
        """The inbox of a request about to start on this group (before its outputs can come)."""
        inbox = Inbox()
        with self._lock:
            if self.failure is not None:
                inbox.put(self.failure)
            else:
                self._inboxes[request_id] = inbox
        return inbox

    def forget(self, request_id: str) -> None:
        """The request is done with (read to its end, or aborted): what still comes for it is
        dropped, and a reader still waiting stops."""
        with self._lock:
            inbox = self._inboxes.pop(request_id, None)
        if inbox is not None:
            _put_all([(inbox, None)])

    def close(self, timeout_s: float = 10.0) -> None:
        """End the stream, and wait until its threads have stopped: a Ray call from them after
        `ray.shutdown` would take this process down."""
        import ray

        self._closed.set()
        with self._lock:
            generator, connection = self._generator, self._connection
        if generator is not None:
            ray.cancel(generator)
        if connection is not None:
            connection.close()
        self._alive.join(timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the output stream of %s did not end in %.0f s", self.name, timeout_s)

    def _keep_alive(self) -> None:
        """Tell the verifier this client is alive, and while requests wait on the stream, see
        that it answers: one that does not within `silent_after_s` (its host cut off, or hung)
        fails the stream as a dead one would, so its requests move to another group instead
        of waiting for Ray to give the node up (tens of seconds)."""
        import ray

        while not self._closed.wait(KEEP_ALIVE_S) and self.failure is None:
            with self._lock:
                waiting = bool(self._inboxes)
            try:
                ref = self.verifier.keep_alive.remote(self.client)
                if waiting:
                    ray.get(ref, timeout=self.silent_after_s)
            except ray.exceptions.GetTimeoutError:
                self._fail(
                    ConnectionError(f"{self.name} has not answered for {self.silent_after_s:g} s")
                )
                return
            except Exception as err:  # unreachable (ActorUnavailableError), dead, or Ray stopping
                # Its requests move on (router/backends.py): the actor's own error, as the
                # stream's end gives it (whichever of the two sees it first), else a
                # ConnectionError.
                if waiting:
                    unreachable = ConnectionError(f"{self.name} is unreachable: {err}")
                    self._fail(err if isinstance(err, actor_gone()) else unreachable)
                log.info("keep-alive to %s stopped: %s: %s", self.name, type(err).__name__, err)
                return

    def _opened(self) -> Iterator[Batch] | OutputConnection:
        """The stream: a connection of its own to the verifier (cluster/output_socket.py), else
        (Ray Client; a verifier this host cannot connect to) its messages through Ray."""
        import ray

        if self._polling:
            return self._polled()
        try:
            address = ray.get(self.verifier.outputs_address.remote(), timeout=self.silent_after_s)
        except ray.exceptions.GetTimeoutError:  # its requests move on (router/backends.py)
            raise ConnectionError(
                f"{self.name} has not answered for {self.silent_after_s:g} s"
            ) from None
        try:
            connection = OutputConnection(address, self.client, self.silent_after_s)
        except OSError as err:
            log.warning(
                "no connection to %s's outputs at %s:%d (%s): its outputs come through Ray",
                self.name, address[0], address[1], err,
            )  # fmt: skip
            generator = self.verifier.outputs.options(num_returns="streaming").remote(self.client)
            with self._lock:
                self._generator = generator
            if self._closed.is_set():
                ray.cancel(generator)
            return self._streamed(generator)
        # A verifier that dies fails this call with its error, which its stream then fails
        # with, as a Ray stream would.
        self._watch = self.verifier.until_closed.remote(self.client)
        with self._lock:
            self._connection = connection
        if self._closed.is_set():  # closed while it opened: `close` may not have seen it
            connection.close()
        return connection

    @staticmethod
    def _streamed(generator: Any) -> Iterator[Batch]:
        import ray

        for ref in generator:
            yield ray.get(ref)

    def _polled(self) -> Iterator[Batch]:
        """Through Ray Client, which has no streaming calls: a call a batch, each waiting at
        most `POLL_WAIT_S` on the verifier for outputs, until this side closes or that one."""
        import ray

        while not self._closed.is_set():
            batch = ray.get(self.verifier.poll_outputs.remote(self.client, POLL_WAIT_S))
            if batch is None:
                return
            if batch:
                yield batch

    def _read(self) -> None:
        failure: BaseException
        try:
            stream = self._opened()
            if isinstance(stream, OutputConnection):
                stream.read(self._hand_out, self._loop)
            else:
                for batch in stream:
                    self._hand_out(batch)
            failure = self._why_ended()
        except BaseException as exc:  # the verifier died, restarted or was shut down
            failure = exc
        self._fail(failure)

    def _why_ended(self) -> BaseException:
        """Why a connection ended: the verifier's death (its error), else the channel's end."""
        import ray

        ended = ConnectionError(f"the output stream of {self.name} ended")
        if self._watch is None or self._closed.is_set():
            return ended
        try:
            ray.get(self._watch, timeout=self.silent_after_s)
        except ray.exceptions.GetTimeoutError:
            return ended
        except Exception as exc:
            return exc
        return ended

    def _fail(self, failure: BaseException) -> None:
        """The stream is broken: every request waiting on it fails with `failure` (once)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
            inboxes, self._inboxes = list(self._inboxes.values()), {}
        log.info("output stream of %s ended: %s", self.name, failure)
        _put_all([(inbox, failure) for inbox in inboxes])

    def _hand_out(self, batch: Batch) -> None:
        with self._lock:  # a request forgotten (aborted by its reader) is waited for by nobody
            inboxes = self._inboxes
            delivered = [(inboxes[rid], item) for rid, item in batch if rid in inboxes]
        _put_all(delivered)


def answer_of(ref: Any) -> asyncio.Future[Any]:
    """A Ray call's answer as a future of this event loop, to wait on with `asyncio.wait` and
    never cancel (Ray Client logs a callback error for a cancelled one when the answer comes);
    its exception counts as seen, for a caller that stops caring about it."""
    future = asyncio.wrap_future(ref.future())
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return future


def actor_gone() -> tuple[type[Exception], ...]:
    """What Ray raises at a call to an actor that died or is restarting."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, if one is."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def ray_client_connected() -> bool:
    """Whether this process reaches Ray through Ray Client (`ray://`): a router pod of the
    chart does. Ray Client has no streaming calls, so its output channels poll."""
    from ray.util.client import ray as client_ray

    return bool(client_ray.is_connected())


def _put_all(delivered: Sequence[tuple[Inbox, Item]]) -> None:
    """Each item into its inbox, then one hand-off to each event loop with readers to wake (on
    that loop's own thread, its readers are woken at once)."""
    woken: dict[asyncio.AbstractEventLoop, list[Inbox]] = {}
    for inbox, item in delivered:
        loop = inbox.put(item)
        if loop is not None:
            woken.setdefault(loop, []).append(inbox)
    if not woken:
        return
    running = running_loop()
    for loop, inboxes in woken.items():
        if loop is running:
            _wake_all(inboxes)
            continue
        # A closed event loop raises: nobody reads there any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_wake_all, inboxes)
