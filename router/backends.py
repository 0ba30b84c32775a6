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

    async def load(self) -> list[LoopLoad]: ...

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

    async def load(self) -> list[LoopLoad]:
        return [self.loop.load()]

    async def ready(self) -> bool:
        return self.loop.ready()

    async def healthy(self, group: int) -> bool:
        return self.loop.ready()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.loop.close)


class RuntimeBackend:
    """The Ray runtime's verifier groups."""

    def __init__(self, runtime: Any, shutdown_on_close: bool = True) -> None:
        self.runtime = runtime
        self.groups = list(runtime.pools.verifier_names)
        self.shutdown_on_close = shutdown_on_close

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
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
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

    async def load(self) -> list[LoopLoad]:
        return list(await self.runtime.load())

    async def ready(self) -> bool:
        try:
            await asyncio.wait_for(
                asyncio.gather(*(v.info.remote() for v in self.runtime.pools.verifiers)), 2.0
            )
        except Exception:
            return False
        return True

    async def healthy(self, group: int) -> bool:
        try:
            await asyncio.wait_for(self.runtime.pools.verifiers[group].info.remote(), 2.0)
        except Exception:
            return False
        return True

    async def close(self) -> None:
        if self.shutdown_on_close:
            await asyncio.get_running_loop().run_in_executor(None, self.runtime.shutdown)


def _cause(exc: BaseException) -> str:
    """The message of the exception a Ray task raised, without Ray's traceback wrapper."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc).strip().splitlines()[-1]
