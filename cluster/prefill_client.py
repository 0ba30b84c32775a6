"""The verifier's side of the prefill pool (the workers' side is cluster/prefill.py): which
prompts go to a worker, the link to each worker, and what a worker that fails or goes silent
costs.

A prompt goes to the next worker in turn when it has at least `min_remote_prompt_tokens`
tokens the verifier's prefix cache does not hold. One prompt at a time crosses a worker's link.
A remote prefill not back within `PrefillPool.deadline_s` of its length is given up, and the
verifier prefills the prompt itself. A worker that did not answer in time (its host cut off,
say) is then passed over for `retry_after_s`, so that later requests do not wait out the same
deadline, and the prompts already queued for it give it up at their turn rather than each
waiting out a deadline of its own. A worker that fails at once (dead or restarting: Ray says
so at once) costs the next request nothing to try again, and that request rebuilds the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from cluster import telemetry
from cluster.actors import RAY_NAMESPACE
from cluster.links import TensorLink, link_backend
from cluster.pool_settings import PrefillPool
from cluster.prefill import LINK_TIMEOUT_S, plan_for, receive
from workers.engine.config import RequestSpec
from workers.engine.outputs import Prefilled

log = logging.getLogger(__name__)
T = TypeVar("T")


class PassedOver(Exception):
    """The worker was found silent while this prompt waited for its turn on it."""


class WorkerTurns:
    """One prompt at a time on each worker, in the order they came; a prompt whose turn comes
    while its worker is passed over (silent within `retry_after_s`) gets `PassedOver`."""

    def __init__(self, workers: int) -> None:
        self.locks = [asyncio.Lock() for _ in range(workers)]
        self.passed_over_until = [0.0] * workers

    def passed_over(self, index: int) -> bool:
        return time.monotonic() < self.passed_over_until[index]

    def pass_over(self, index: int, for_s: float) -> None:
        self.passed_over_until[index] = time.monotonic() + for_s

    @contextlib.asynccontextmanager
    async def turn(self, index: int) -> AsyncIterator[None]:
        async with self.locks[index]:
            if self.passed_over(index):
                raise PassedOver(f"worker {index} was passed over while this prompt waited")
            yield


class PrefillClient:
    def __init__(
        self,
        owner: str,
        names: list[str],
        settings: PrefillPool,
        model_config: Any,
        dtype: str,
        device: str,
    ) -> None:
        import ray

        self.owner, self.names, self.settings = owner, names, settings
        # The whole model's config: a worker sends every KV head.
        self.model_config, self.dtype, self.device = model_config, dtype, device
        self.actors = [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in names]
        self.links: list[TensorLink | None] = [None] * len(names)
        self.turns = WorkerTurns(len(names))
        self._next = 0
        self.stats: dict[str, float] = {
            "remote": 0,
            "local": 0,
            "failures": 0,
            "passed_over": 0,  # prefilled here: the worker was silent within retry_after_s
            "bytes": 0,
            "compute_s": 0.0,
            "transfer_s": 0.0,
            "reused_tokens": 0,  # prompt tokens a worker had from its previous prompt
        }

    def connect(self, index: int) -> TensorLink:
        """A new link to worker `index` (waits on Ray and on the worker's join)."""
        import ray

        peer: Any = ray.get(self.actors[index].info.remote(), timeout=60)
        backend = link_backend(self.device, peer["device"])
        name = f"{self.owner}-{self.names[index]}"
        link = TensorLink.host(name, backend, timeout_s=LINK_TIMEOUT_S)
        joined: Any = self.actors[index].open_link.remote(link.address, self.owner)
        link.connect_racing(joined)  # a worker that dies now fails here at once
        ray.get(joined, timeout=60)
        return link

    async def prefill(
        self, engine: Any, request_id: str, prompt_ids: list[int], spec: RequestSpec, carrier: Any
    ) -> tuple[Prefilled, str] | None:
        """The whole prompt computed by a worker (its K/V, features, last logits) and the
        worker's name; None to prefill on the verifier (no worker, too few tokens left to
        compute once the prefix cache has given what it holds, or the worker failed)."""
        if len(prompt_ids) >= engine.max_model_len:
            return None  # the engine rejects it, with the message (a worker has no room either)
        uncached = len(prompt_ids) - 1 - engine.cached_prefix_tokens(prompt_ids)
        if not self.actors or uncached < max(1, self.settings.min_remote_prompt_tokens):
            self.stats["local"] += 1
            return None
        try:
            method, _ = engine.speculator.resolve(spec)
        except ValueError:
            return None  # the engine rejects the request itself, with the message
        drafter = engine.speculator.drafters.get(method)
        layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        index = self._next % len(self.actors)
        self._next += 1
        if self.turns.passed_over(index):
            self.stats["passed_over"] += 1
            return None
        plan = plan_for(self.model_config, len(prompt_ids), layers, self.dtype)
        span = telemetry.tracer().start_span(
            "outrider.kv_transfer", context=telemetry.extract(carrier)
        )

        async def remote() -> tuple[Any, dict[str, Any]]:
            async with self.turns.turn(index):
                # Taken while in use, back only once this prompt has crossed it whole: a prompt
                # given up on leaves the rest of its tensors on its link, for no later prompt
                # to read as its own.
                link, self.links[index] = self.links[index], None
                if link is None or not link.connected:
                    link = await on_thread(self.connect, index)
                ref: Any = self.actors[index].prefill.remote(prompt_ids, layers, self.owner)
                result = await on_thread(receive, link, plan, prompt_ids)
                timing = await ref
                self.links[index] = link
                return result, timing

        deadline_s = self.settings.deadline_s(len(prompt_ids))
        try:
            # A link's receive cannot be interrupted: given up, it stays blocked on its own
            # thread until the link's timeout, and the link is not used again.
            result, timing = await asyncio.wait_for(remote(), deadline_s)
        except PassedOver:
            self.stats["passed_over"] += 1
            span.end()
            return None
        except Exception as err:
            self._failed(index, err, deadline_s)
            span.end()
            return None
        span.set_attributes(
            {
                "outrider.request_id": request_id,
                "outrider.prefill_worker": self.names[index],
                "outrider.prefill_tokens": plan.num_tokens,
                "outrider.bytes_moved": timing["bytes"],
                "outrider.prefill.compute_s": round(timing["compute_s"], 6),
                "outrider.prefill.transfer_s": round(timing["transfer_s"], 6),
                "outrider.prefill.reused_tokens": timing["reused_tokens"],
            }
        )
        span.end()
        self.stats["remote"] += 1
        for key in ("bytes", "compute_s", "transfer_s", "reused_tokens"):
            self.stats[key] += timing[key]
        return Prefilled(result.kv, result.hidden or None, result.logits), self.names[index]

    def _failed(self, index: int, err: Exception, deadline_s: float) -> None:
        silent = isinstance(err, TimeoutError)
        if silent:
            err = TimeoutError(f"not back in {deadline_s:.1f} s")
            self.turns.pass_over(index, self.settings.retry_after_s)
        log.warning(
            "remote prefill on %s failed (%s: %s); prefilling here%s",
            self.names[index],
            type(err).__name__,
            err,
            f", and passing it over for {self.settings.retry_after_s:.0f} s" if silent else "",
        )
        self.stats["failures"] += 1


def on_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """`fn(*args)` on a thread of its own, as a future of this event loop. Not a pool's: a
    link's receive given up on blocks its thread until the link's timeout, and a pool's
    threads would run out for the prompts after it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # its caller gave up on it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as err:
            error = err
        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="prefill-link", daemon=True).start()
    return future
