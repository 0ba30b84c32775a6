"""What the router dispatches to: verifier groups that stream a request's tokens.

`RuntimeBackend` is the production path: the Ray runtime's verifier groups (each one an engine
with its drafter and prefill pools behind it). `LocalBackend` is one in-process engine, for
`outrider serve` without a cluster and for fast tests of the router itself; both stream through
the same asyncio interface, and leaving a stream early aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from cluster.output_reader import actor_gone, answer_of
from router import errors
from workers.engine.config import RequestSpec
from workers.engine.engine_loop import EngineLoop, LoopLoad
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.outputs import Continuation, RequestOutput
from workers.engine.sampling_params import SamplingParams

# What one engine step produced for one request: the engine's own output, whichever backend.
Step = RequestOutput


class Backend(Protocol):
    groups: list[str]  # verifier group names, index = group

    def stream(
        self,
        group: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None,
        continuation: Continuation | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> AsyncGenerator[Step, None]:
        """The request's steps on group `group`; raises `errors.GroupFailed` when the group
        fails under it (the request may go on elsewhere with `continuation`). `share`: its
        tenant, weight and priority in the engine (workers/engine/fair_share.py)."""
        ...

    async def load(self) -> list[LoopLoad | None]:
        """Each group's load; None for a group that did not answer in time (down, or its host
        cut off): routing sends it nothing until it answers again."""
        ...

    async def ready(self) -> bool: ...

    async def healthy(self, group: int) -> bool:
        """Whether group `group` answers now (a failed one is restarting until it does)."""
        ...

    async def close(self) -> None: ...


class LocalBackend:
    """One in-process engine (an `EngineLoop`) as a single verifier group."""

    def __init__(self, loop: EngineLoop, name: str = "local") -> None:
        self.loop = loop
        self.groups = [name]

    async def stream(
        self,
        group: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None,
        continuation: Continuation | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> AsyncGenerator[Step, None]:
        outputs = self.loop.stream(
            request_id, prompt_ids, params, spec, None, continuation, share=share
        )
        try:
            async for out in outputs:
                yield out
        except ValueError as exc:  # the engine refused it (unknown method, too long)
            raise errors.bad_request(str(exc)) from exc
        except RuntimeError as exc:
            raise errors.server_error(str(exc)) from exc
        finally:
            await outputs.aclose()

    async def load(self) -> list[LoopLoad | None]:
        return [self.loop.load()]

    async def ready(self) -> bool:
        return self.loop.ready()

    async def healthy(self, group: int) -> bool:
        return self.loop.ready()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.loop.close)


class RuntimeBackend:
    """The Ray runtime's verifier groups."""

    def __init__(
        self, runtime: Any, shutdown_on_close: bool = True, answer_within_s: float = 2.0
    ) -> None:
        """`answer_within_s`: a verifier asked how it is (load, health) answers within this or
        is taken for down; one whose host is cut off never answers, and neither routing nor
        readiness may wait for Ray to give its node up (tens of seconds)."""
        self.runtime = runtime
        self.groups = list(runtime.pools.verifier_names)
        self.shutdown_on_close = shutdown_on_close
        self.answer_within_s = answer_within_s
        self._load_polls: dict[int, asyncio.Future[Any]] = {}  # the last, by group

    async def stream(
        self,
        group: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None,
        continuation: Continuation | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> AsyncGenerator[Step, None]:
        import ray

        stream = self.runtime.submit(
            prompt_ids, params, spec, request_id, group, continuation, share=share
        )
        finished = False
        try:
            async for message in stream.items_async():
                finished = message.output.finished
                yield message.output
        except ValueError as exc:  # RayTaskError subclasses the actor's own exception type
            raise errors.bad_request(_cause(exc)) from exc
        except actor_gone() as exc:
            raise errors.GroupFailed(f"verifier {self.groups[group]} is unavailable") from exc
        except ray.exceptions.RayError as exc:
            raise errors.server_error(_cause(exc)) from exc
        except ConnectionError as exc:  # the group's output stream ended under it
            raise errors.GroupFailed(f"verifier {self.groups[group]} is unavailable") from exc
        except RuntimeError as exc:  # the engine failed it (or the step it was in)
            raise errors.server_error(str(exc)) from exc
        finally:
            if not finished:  # the client left (or the stream failed): free its KV blocks
                self.runtime.abort(stream)

    async def load(self) -> list[LoopLoad | None]:
        """Each group's load, waiting `answer_within_s` at most; None for a group that did not
        answer. A group whose last poll is still unanswered is not polled or waited for again
        until it answers: routing goes on without it at once."""
        polls: list[asyncio.Future[Any]] = []
        fresh = []
        for group, verifier in enumerate(self.runtime.pools.verifiers):
            poll = self._load_polls.get(group)
            if poll is None or poll.done():
                poll = self._load_polls[group] = answer_of(verifier.load.remote())
                fresh.append(poll)
            polls.append(poll)
        if fresh:
            await asyncio.wait(fresh, timeout=self.answer_within_s)
        return [_answer(poll) for poll in polls]

    async def ready(self) -> bool:
        calls = [answer_of(v.info.remote()) for v in self.runtime.pools.verifiers]
        await asyncio.wait(calls, timeout=self.answer_within_s)
        return all(_answer(call) is not None for call in calls)

    async def healthy(self, group: int) -> bool:
        call = answer_of(self.runtime.pools.verifiers[group].info.remote())
        await asyncio.wait([call], timeout=self.answer_within_s)
        return _answer(call) is not None

    async def close(self) -> None:
        if self.shutdown_on_close:
            await asyncio.get_running_loop().run_in_executor(None, self.runtime.shutdown)


def _answer(future: asyncio.Future[Any]) -> Any:
    """A call's result (`answer_of`), or None when it has not answered or failed."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return None
    return future.result()


def _cause(exc: BaseException) -> str:
    """The message of the exception a Ray task raised, without Ray's traceback wrapper."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc).strip().splitlines()[-1]
