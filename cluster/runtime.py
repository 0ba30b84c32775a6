"""The client API over a running deployment's pools: `Runtime.start(config)` joins a Ray
cluster (or starts a local one) and starts the pools or finds them running (cluster/pools.py);
clients (the router, `router/backends.py`) call `submit` for a `RequestStream` of per-step
messages from the verifier (sync or asyncio iteration; all of this process's requests on a group
share one output channel, cluster/output_channel.py) and `abort` (which aborts the request in
the engine and frees its KV blocks); the router asks each verifier actor its load itself
(router/backends.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from cluster import telemetry
from cluster.actors import start_tracing
from cluster.config import DeploymentConfig, resolve_gpus
from cluster.output_channel import ServedBy, StreamedStep
from cluster.output_reader import GroupOutputs, Inbox, answer_of, running_loop
from cluster.pools import Pools, attach_pools, check_fits, connect_ray, start_pools
from workers.engine.config import RequestSpec
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.outputs import Continuation, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestStream:
    """Token lists of one request as the verifier produces them."""

    request_id: str
    verifier: str
    started: Any  # the ObjectRef of the verifier's `start` call
    inbox: Inbox  # its messages, from its group's output channel
    channel: GroupOutputs
    span: Any = None  # the request's span, ended with the stream
    finish_reason: str | None = None
    spec: SpecStats | None = None
    served_by: ServedBy | None = None
    text: list[str] = field(default_factory=list)
    output_tokens: int = 0

    def outputs(self) -> Iterator[RequestOutput]:
        """The stream as the engine's own `RequestOutput`s."""
        for message in self._items():
            yield message.output

    def __iter__(self) -> Iterator[list[int]]:
        for message in self._items():
            if message.output.new_token_ids:
                yield message.output.new_token_ids

    def _items(self) -> Iterator[StreamedStep]:
        import ray

        try:
            ray.get(self.started)
            while (item := self.inbox.get()) is not None:  # None: aborted
                message = self._record(item)
                yield message
                if message.output.finished:
                    return
        finally:
            self._end()

    async def items_async(self) -> AsyncIterator[StreamedStep]:
        """The verifier's messages, for asyncio callers (the router)."""
        try:
            item = await self._first_item()
            while item is not None:  # None: aborted
                message = self._record(item)
                yield message
                if message.output.finished:
                    return
                item = await self.inbox.get_async()
        finally:
            self._end()

    async def _first_item(self) -> StreamedStep | BaseException | None:
        """The first item, once the verifier took the request (its `start` call raises what
        refused it) or the channel failed it, whichever comes first: a verifier whose host is
        cut off never answers the call, and its channel's keep-alive gives it up in seconds
        where Ray takes tens to give up the node."""
        started = answer_of(self.started)
        first = asyncio.ensure_future(self.inbox.get_async())
        try:
            await asyncio.wait([started, first], return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                started.result()  # raises what refused the request
            return await first
        finally:
            first.cancel()  # if the reader left first

    def _record(self, message: StreamedStep | BaseException) -> StreamedStep:
        """A message taken in (an exception raised: the verifier refused or failed the request,
        or its channel broke)."""
        if isinstance(message, BaseException):
            raise message
        out = message.output
        self.text.append(out.text)
        self.output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.spec = out.finish_reason, out.spec
            self.served_by = message.served_by
        return message

    def _end(self) -> None:
        self.channel.forget(self.request_id)
        if self.span is not None:
            self.span.set_attribute("outrider.output_tokens", self.output_tokens)
            self.span.set_attribute("outrider.finish_reason", self.finish_reason or "abort")
            self.span.end()
            self.span = None


@dataclass(slots=True)
class Runtime:
    """A running deployment: its pools and the client API over them."""

    config: DeploymentConfig
    pools: Pools
    owns_ray: bool  # this process started Ray (and stops it)
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _channels: dict[int, GroupOutputs] = field(default_factory=dict)  # by group, made when used

    @classmethod
    def start(
        cls,
        config: DeploymentConfig,
        address: str | None = None,
        num_cpus: int | None = None,
        placement_timeout_s: float = 120.0,
    ) -> Runtime:
        """Join the Ray cluster at `address` (default: the config's; none: start a local one)
        and serve the pools running there for this deployment, or start them."""
        import ray

        address = address or config.ray.address
        start_tracing(config)
        owns = connect_ray(config, address, num_cpus)
        pools = attach_pools(config) if address is not None else None
        if pools is None:
            resources = ray.cluster_resources()
            # Pools that leave `gpus` null get a GPU per actor where the cluster has enough.
            config = resolve_gpus(config, resources.get("GPU", 0.0))
            try:
                if owns and address is None:  # a local cluster started here: it cannot grow
                    check_fits(config, resources)
                pools = start_pools(config, address is not None, placement_timeout_s)
            except BaseException:
                if owns:
                    ray.shutdown()
                raise
        return cls(config, pools, owns)

    @classmethod
    def attach(cls, config: DeploymentConfig) -> Runtime | None:
        """The pools another process started on the Ray cluster this process joined, or None
        when there are none yet."""
        pools = attach_pools(config)
        return None if pools is None else cls(config, pools, owns_ray=False)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None = None,
        request_id: str | None = None,
        group: int | None = None,
        continuation: Continuation | None = None,
        *,
        share: Share = DEFAULT_SHARE,
    ) -> RequestStream:
        """Start a request on verifier group `group` (round-robin when None; the router picks
        by cached prefix and load); with `continuation`, one that moved from a failed group.
        `share`: its tenant, weight and priority in the engine."""
        with self._lock:
            if group is None:
                group = self._next % len(self.pools.verifiers)
                self._next += 1
            request_id = request_id or f"req-{next(self._ids)}-{time.time_ns()}"
        index = group
        spec = spec or RequestSpec()
        span = telemetry.tracer().start_span("outrider.request")
        span.set_attributes(
            {
                "outrider.request_id": request_id,
                "outrider.verifier": self.pools.verifier_names[index],
                "outrider.prompt_tokens": len(prompt_ids),
            }
        )
        if continuation is not None:  # moved here from a group that failed under it
            span.set_attribute("outrider.continued_tokens", len(continuation.token_ids))
        carrier = telemetry.inject(span)
        channel = self._channel(index)
        inbox = channel.register(request_id)  # before any output of it can come
        verifier = self.pools.verifiers[index]
        started = verifier.start.remote(
            request_id, list(prompt_ids), params, spec, channel.client, carrier, continuation, share
        )
        name = self.pools.verifier_names[index]
        return RequestStream(request_id, name, started, inbox, channel, span)

    def _channel(self, group: int) -> GroupOutputs:
        """This process's output channel from verifier group `group`: a new one when there is
        none yet or the last one broke (its verifier failed, and may be back). Made on an event
        loop (the router's), it is read there."""
        loop = running_loop()
        with self._lock:
            channel = self._channels.get(group)
            if channel is None or channel.broken:
                verifier = self.pools.verifiers[group]
                silent_after_s = self.config.router.deadlines.silent_after_s
                name = self.pools.verifier_names[group]
                channel = GroupOutputs(verifier, name, silent_after_s, loop)
                self._channels[group] = channel
            return channel

    def abort(self, stream: RequestStream) -> None:
        stream.channel.forget(stream.request_id)
        stream.channel.verifier.abort.remote(stream.request_id)

    def verifier_stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([v.stats.remote() for v in self.pools.verifiers])

    def metrics_url(self) -> str:
        """Ray's Prometheus endpoint on the head node, where the actors' engine metrics are
        (cluster/engine_metrics.py); every node serves its own actors' on its port."""
        import ray

        head = next((n for n in ray.nodes() if n.get("Alive")), ray.nodes()[0])
        return f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"

    def actor_info(self) -> dict[str, list[dict[str, Any]]]:
        import ray

        return {
            "verifiers": ray.get([v.info.remote() for v in self.pools.verifiers]),
            "drafters": ray.get([d.info.remote() for d in self.pools.drafters]),
            "prefill": ray.get([p.info.remote() for p in self.pools.prefills]),
        }

    def shutdown(self, stop_pools: bool | None = None) -> None:
        """Stop the pools (by default only those this runtime started for itself: pools it
        attached to, or started detached for a cluster it joined, stay for the other router
        replicas) and, if it started Ray, Ray."""
        import ray

        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        if stop_pools is None:
            stop_pools = not (self.pools.attached or self.pools.detached)
        if stop_pools:
            self.pools.stop()
        telemetry.flush_tracing()  # this process's request spans
        if self.owns_ray:
            ray.shutdown()
