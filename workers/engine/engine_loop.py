"""An `LLMEngine` stepped by a background thread, for callers on other threads.

Callers `submit` a request and read its `RequestOutput`s from a queue (one item per engine step
that produced something for it, the last one marked finished); `abort` stops a request and
frees its blocks. Requests that arrive while others run join the next step (continuous
batching). The engine itself is only ever touched by the loop thread: the thread that built it
hands back its OpenMP workers when the loop starts (kernels/openmp.py).

`stream` is the asyncio form of `submit`: outputs reach the caller's event loop through
`call_soon_threadsafe`, so a server holds thousands of open requests without a thread each.
A step's outputs go to each event loop in one hand-off (one wake-up of that loop, rather than
one per request: at 256 requests that was over a millisecond of the loop thread's step).
Their text is made there, by the caller, not by the loop thread (workers/engine/output_text.py:
about a fifth of a decode step's host work); a stop string found there ends the caller's
stream and aborts the request. A caller for whom the hand-off costs more than the work it moves
(a CPU verifier's output channels, where the loop thread's step is the whole host's) has its
consumer called on the loop thread instead (`start(on_loop_thread=True)`), and `handed_over`
once a step. A step asks the loop between layers whether a request has come
that the fair share lets in at once, and is given up for it (workers/engine/step_interrupt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kernels.openmp import release_thread_pool
from workers.engine.config import RequestSpec
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.llm_engine import LLMEngine
from workers.engine.output_text import OutputText
from workers.engine.outputs import Continuation, Prefilled, RequestOutput
from workers.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class _Sink(Protocol):
    def put(self, item: RequestOutput | Exception) -> None: ...


Consume = Callable[[RequestOutput | Exception], None]


class _AsyncSink:
    """Hands a request's items from the loop thread to `consume`, called on the caller's event
    loop (`_deliver` hands a step's items for one event loop over at once)."""

    def __init__(self, consume: Consume) -> None:
        self.loop = asyncio.get_running_loop()
        self.consume = consume

    def put(self, item: RequestOutput | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.consume, item)
        except RuntimeError as exc:  # the caller's event loop is closed
            raise ReaderGone(str(exc)) from exc


class _ThreadSink:
    """Hands a request's items to `consume` on the loop thread itself, as they come: for a
    consumer that is cheaper there than a wake-up of another thread's event loop a step
    (`start(on_loop_thread=True)`)."""

    loop = None

    def __init__(self, consume: Consume, request_id: str) -> None:
        self.consume, self.request_id = consume, request_id

    def put(self, item: RequestOutput | Exception) -> None:
        try:
            self.consume(item)
        except Exception:
            log.exception("the consumer of request %s's outputs failed", self.request_id)


_Delivery = tuple["_AsyncSink", RequestOutput | Exception, str]  # sink, item, request id


def _put_each(items: list[_Delivery]) -> None:
    """On the event loop: each item to its request's consumer (one that raises is logged, and
    the others still get theirs)."""
    for sink, item, request_id in items:
        try:
            sink.consume(item)
        except Exception:
            log.exception("the consumer of request %s's outputs failed", request_id)


class ReaderGone(Exception):
    """A request's outputs have no reader any more (its caller's event loop closed before the
    request's abort came through): the loop aborts the request instead of dying on it."""


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    spec: RequestSpec | None
    outputs: _Sink
    prefilled: Prefilled | None = None
    continuation: Continuation | None = None
    share: Share = DEFAULT_SHARE


@dataclass(frozen=True, slots=True)
class LoopLoad:
    """How busy the engine is, for load-aware routing (read without a lock: a hint)."""

    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks held by requests

    @property
    def queue_depth(self) -> int:
        return self.running + self.waiting


class EngineLoop:
    """`fatal`, when given, sees every exception a step raises before the running requests are
    failed with it, and may end the process: a tensor-parallel verifier whose group broke has
    Ray restart it (cluster/verifier.py), so that its requests fail with the actor instead."""

    def __init__(
        self,
        engine: LLMEngine,
        fatal: Callable[[Exception], None] | None = None,
        handed_over: Callable[[], None] | None = None,
    ) -> None:
        """`handed_over`, when given, is called on the loop thread each time it has handed
        what it had over to the requests' consumers (a step's outputs; refusals)."""
        self.engine = engine
        self._handed_over = handed_over
        engine.makes_text = False  # its callers make the text (`_text`), off the loop thread
        # From here the loop thread alone runs the model: the OpenMP workers the building
        # thread kept would make every parallel region of the loop's pay a wake-up
        # (kernels/openmp.py).
        release_thread_pool()
        self._fatal = fatal
        self._inbox: queue.Queue[_Submit | str] = queue.Queue()  # submissions and abort ids
        self._streams: dict[str, _Sink] = {}
        # The shares of submissions not taken in yet (by id), for a step to be given up for
        # (workers/engine/step_interrupt.py).
        self._arriving: dict[int, Share] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        spec: RequestSpec | None = None,
        prefilled: Prefilled | None = None,
        continuation: Continuation | None = None,
        *,
        share: Share = DEFAULT_SHARE,
    ) -> Iterator[RequestOutput]:
        """Outputs of the request as the engine produces them; raises ValueError if rejected."""
        outputs: queue.Queue[RequestOutput | Exception] = queue.Queue()
        item = _Submit(
            request_id, prompt_token_ids, params, spec, outputs, prefilled, continuation, share
        )
        text = self._text(params, continuation)
        self._enqueue(item)
        return self._iterate(request_id, outputs, text)

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        spec: RequestSpec | None = None,
        prefilled: Prefilled | None = None,
        continuation: Continuation | None = None,
        *,
        share: Share = DEFAULT_SHARE,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`submit` for asyncio callers. Leaving the iteration early (the consumer was cancelled
        or closed it) aborts the request and frees its blocks."""
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.start(
            request_id, prompt_token_ids, params, spec, prefilled, continuation, outputs,
            share=share,
        )  # fmt: skip
        ended = False  # finished (a stop string in its text aborted it already), failed, refused
        try:
            while not ended:
                item = await outputs.get()
                if isinstance(item, Exception):
                    ended = True
                    raise item
                ended = item.finished
                yield item
        finally:
            if not ended:
                self.abort(request_id)

    def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        spec: RequestSpec | None,
        prefilled: Prefilled | None,
        continuation: Continuation | None,
        outputs: asyncio.Queue[RequestOutput | Exception] | Consume,
        *,
        share: Share = DEFAULT_SHARE,
        on_loop_thread: bool = False,
    ) -> None:
        """`stream` without a generator, for a caller that gathers many requests' outputs (a
        verifier's channel to its router, cluster/output_channel.py): each output of the
        request, its text made, or the exception that refused or failed it, goes to `outputs`
        (a queue, or a function) on the caller's event loop, or with `on_loop_thread` (a
        function that may be called from any thread) on the loop thread itself, text made
        there too. A stop string found in the text ends the request there and aborts it;
        `abort` stops it before."""
        consume = outputs.put_nowait if isinstance(outputs, asyncio.Queue) else outputs
        text = self._text(params, continuation)

        def deliver(item: RequestOutput | Exception) -> None:
            consume(self._with_text(request_id, text, item))

        sink: _Sink = _ThreadSink(deliver, request_id) if on_loop_thread else _AsyncSink(deliver)
        self._enqueue(
            _Submit(
                request_id, prompt_token_ids, params, spec, sink, prefilled, continuation, share
            )
        )

    def _with_text(
        self, request_id: str, text: OutputText | None, item: RequestOutput | Exception
    ) -> RequestOutput | Exception:
        """`item` with its text made, in the caller's thread: a stop string found there ends
        the request (aborted in the engine), and a text that fails ends it with the error."""
        if isinstance(item, Exception) or text is None:
            return item
        try:
            stopped = text.apply(item)
        except Exception as exc:
            log.exception("the text of request %s failed", request_id)
            stopped, item = True, RuntimeError(f"its text failed: {exc!r}")
        if stopped:
            self.abort(request_id)
        return item

    def _text(self, params: SamplingParams, continuation: Continuation | None) -> OutputText | None:
        """What makes a request's text in its caller's thread (None: an engine without a
        tokenizer, whose outputs have none)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return None
        carried = () if continuation is None else continuation.token_ids
        return OutputText(tokenizer, params, self.engine.eos_token_ids, carried)

    def load(self) -> LoopLoad:
        engine: Any = self.engine
        allocator = engine.allocator
        held = allocator.num_blocks - allocator.num_free_blocks
        return LoopLoad(
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
            held / allocator.num_blocks,
        )

    def ready(self) -> bool:
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._enqueue(request_id)

    def _enqueue(self, item: _Submit | str) -> None:
        """Hand a submission (or an abort id) to the loop thread and wake it."""
        if isinstance(item, _Submit):
            self._arriving[id(item)] = item.share
        self._inbox.put(item)
        self._wake.set()

    def _arrived(self) -> list[Share]:
        """Asked by a step between layers (on the loop thread): the shares of the requests
        submitted and not taken in yet (other threads add to them meanwhile)."""
        return list(self._arriving.values())

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _iterate(
        self,
        request_id: str,
        outputs: queue.Queue[RequestOutput | Exception],
        text: OutputText | None,
    ) -> Iterator[RequestOutput]:
        while True:
            item = self._with_text(request_id, text, outputs.get())
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            aborted = self._drain_inbox()
            # First tokens sampled from a prefill worker's logits go out before the next forward.
            self._deliver(self.engine.take_outputs())
            if not (self.engine.has_unfinished_requests() or aborted):
                self._hand_over()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step(self._arrived)
            except Exception as exc:  # a bug must not hang every client: fail the running ones
                if self._fatal is not None:
                    self._fatal(exc)
                log.exception(
                    "engine step failed; failing the %d running requests", len(self._streams)
                )
                self._fail_all(exc)
                self._hand_over()
                continue
            self._deliver(outputs)
            self._hand_over()

    def _hand_over(self) -> None:
        if self._handed_over is not None:
            try:
                self._handed_over()
            except Exception:
                log.exception("handing the outputs over failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # a request that failed alone gets its error
                item = out if out.error is None else RuntimeError(out.error)
                if isinstance(stream, _AsyncSink):
                    by_loop.setdefault(stream.loop, []).append((stream, item, out.request_id))
                else:
                    stream.put(item)
            if out.finished:
                self._streams.pop(out.request_id, None)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_each, items)
            except RuntimeError:  # that event loop is closed: its requests have no reader
                for _, _, request_id in items:
                    if self._streams.pop(request_id, None) is not None:
                        self.engine.abort_request(request_id)

    def _drain_inbox(self) -> bool:
        """Take in submissions and aborts; whether anything was aborted."""
        aborted = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
            if isinstance(item, str):
                self.engine.abort_request(item)
                aborted = True
                continue
            self._arriving.pop(id(item), None)
            try:
                self.engine.add_request(
                    item.request_id,
                    item.prompt_token_ids,
                    item.params,
                    item.spec,
                    item.prefilled,
                    item.continuation,
                    share=item.share,
                )
            except ValueError as exc:
                with contextlib.suppress(ReaderGone):
                    item.outputs.put(exc)
                continue
            self._streams[item.request_id] = item.outputs

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            with contextlib.suppress(ReaderGone):
                stream.put(RuntimeError(f"engine step failed: {exc!r}"))
        self._streams.clear()
        self.engine.step()  # drain the abort outputs
