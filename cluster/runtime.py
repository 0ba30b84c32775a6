"""The disaggregated runtime on Ray: pools of named actors, and the client API over them.

`Runtime.start(config)` starts a local Ray cluster (or joins one), creates one placement group
per pool and the named actors in it:

- `drafter-<i>`: a `DrafterWorker` running the pool's drafting method (CPU, plus any custom
  resource such as `grace_cpu` that the config names, so drafters land on the Grace CPU beside
  a GPU on GB200 nodes). Restarted by Ray if it dies; its verifier re-adds its sequences.
- `prefill-<i>`: a `PrefillWorker` computing prompts' K/V (and EAGLE features) and sending them to
  the verifier over a tensor link.
- `verifier-g<g>-r0` (and `-r1`... for tensor parallelism): the engine (continuous batching,
  verification) with model-free drafters in-process and the drafter pool behind
  `RemoteDrafter`s.

Clients (the router, `router/backends.py`) call `submit` for a `RequestStream` of per-step dicts
from the verifier's streaming generator (sync or asyncio iteration), `abort` (`ray.cancel` on the
stream, which aborts the request in the engine and frees its KV blocks) and `load` (each group's
queue depth and KV usage, for routing).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from cluster import telemetry
from cluster.actors import (
    RAY_NAMESPACE,
    DrafterActor,
    PrefillActor,
    VerifierRankActor,
    start_tracing,
)
from cluster.config import DeploymentConfig, Resources, resolve_gpus, settings_differ
from cluster.verifier import ServedBy, StreamedStep, VerifierActor
from workers.engine.config import RequestSpec
from workers.engine.engine_loop import LoopLoad
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """A pool's placement group cannot be placed on this cluster."""


def _wait_placed(pg: Any, pool: str, bundles: list[dict[str, float]], timeout_s: float) -> None:
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        raise PlacementError(
            f"the {pool} pool's placement group {bundles} could not be placed within "
            f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
        ) from None


@dataclass(slots=True)
class RequestStream:
    """Token lists of one request as the verifier produces them."""

    request_id: str
    verifier: str
    generator: Any  # Ray's ObjectRefGenerator
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
            for ref in self.generator:
                yield self._record(ray.get(ref))
        finally:
            self._end_span()

    async def items_async(self) -> AsyncIterator[StreamedStep]:
        """The verifier's messages, for asyncio callers (the router)."""
        try:
            async for ref in self.generator:
                yield self._record(await ref)
        finally:
            self._end_span()

    def _record(self, message: StreamedStep) -> StreamedStep:
        out = message.output
        self.text.append(out.text)
        self.output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.spec = out.finish_reason, out.spec
            self.served_by = message.served_by
        return message

    def _end_span(self) -> None:
        if self.span is not None:
            self.span.set_attribute("outrider.output_tokens", self.output_tokens)
            self.span.set_attribute("outrider.finish_reason", self.finish_reason or "abort")
            self.span.end()
            self.span = None


def _cpus_needed(config: DeploymentConfig) -> float:
    pools = config.pools
    return (
        pools.prefill.replicas * pools.prefill.resources.cpus
        + pools.verifier.groups
        * pools.verifier.tensor_parallel_size
        * pools.verifier.resources.cpus
        + pools.drafter.replicas * pools.drafter.resources.cpus
    )


def _bundle(resources: Resources) -> dict[str, float]:
    bundle = {"CPU": resources.cpus, **resources.custom}
    if resources.gpus:
        bundle["GPU"] = resources.gpus
    return bundle


@dataclass(slots=True)
class Runtime:
    """A running deployment: its actors and the client API over them."""

    config: DeploymentConfig
    verifiers: list[Any]
    verifier_names: list[str]
    drafters: list[Any]
    drafter_names: list[str]
    placement_groups: list[Any]
    owns_ray: bool
    prefills: list[Any] = field(default_factory=list)
    prefill_names: list[str] = field(default_factory=list)
    ranks: list[Any] = field(default_factory=list)  # verifier ranks > 0
    attached: bool = False  # joined pools another process started (and will not stop them)
    # Started the pools for a cluster this process joined (a router replica): they are Ray's
    # detached actors and outlive it, for the other replicas.
    detached: bool = False
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(
        cls,
        config: DeploymentConfig,
        address: str | None = None,
        num_cpus: int | None = None,
        placement_timeout_s: float = 120.0,
    ) -> Runtime:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        address = address or config.ray.address
        start_tracing(config)
        owns = not ray.is_initialized()
        if owns and address is None and num_cpus is None:
            # A local cluster gets at least the CPUs its pools ask for: on a small machine the
            # actors share cores (logical CPUs), which is what a laptop deployment wants.
            num_cpus = max(os.cpu_count() or 1, math.ceil(_cpus_needed(config)))
        if owns:
            for attempt in range(3):
                try:
                    ray.init(
                        address=address,
                        namespace=RAY_NAMESPACE,
                        num_cpus=num_cpus if address is None else None,
                        include_dashboard=address is None,
                        dashboard_host=config.ray.dashboard_host,
                        dashboard_port=config.ray.dashboard_port,
                        log_to_driver=False,
                    )
                    break
                except ValueError as err:
                    # A cluster this process just shut down can hold the dashboard port for
                    # a moment.
                    if "already occupied" not in str(err) or attempt == 2:
                        raise
                    ray.shutdown()
                    time.sleep(3.0)
        if address is not None:
            running = cls.attach(config)
            if running is not None:
                running.owns_ray = owns
                return running
        # Pools started from a process that joined a cluster (a router replica) must outlive
        # it: detached actors; a local runtime's actors go with it.
        lifetime = "detached" if address is not None else None

        def _placed(pool: str, count: int, resources: Resources, strategy: str) -> Any:
            bundles = [_bundle(resources)] * count
            pg = placement_group(bundles, strategy=strategy, lifetime=lifetime)
            _wait_placed(pg, pool, bundles, placement_timeout_s)
            return pg

        def _actors_in(
            pg: Any,
            body: type,
            names: list[str],
            resources: Resources,
            args: list[tuple[Any, ...]],
            first_bundle: int = 0,
            **options: Any,
        ) -> list[Any]:
            """Named actors of `body` (constructor arguments `args[i]`), one per bundle of `pg`
            from `first_bundle` on."""
            actor_cls: Any = ray.remote(body)
            return [
                actor_cls.options(
                    name=name,
                    namespace=RAY_NAMESPACE,
                    lifetime=lifetime,
                    num_cpus=resources.cpus,
                    num_gpus=resources.gpus,
                    resources=dict(resources.custom),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, first_bundle + i),
                    **options,
                ).remote(*actor_args)
                for i, (name, actor_args) in enumerate(zip(names, args, strict=True))
            ]

        # Pools that leave `gpus` null get a GPU per actor where the cluster has enough.
        config = resolve_gpus(config, ray.cluster_resources().get("GPU", 0.0))
        groups: list[Any] = []
        drafters: list[Any] = []
        prefills: list[Any] = []
        verifiers: list[Any] = []
        ranks: list[Any] = []
        try:
            plain = config.to_dict()
            pools = config.pools
            names: dict[str, list[str]] = {}
            # Drafters and prefill workers: one actor per bundle, spread over nodes.
            for pool, body, actors, settings in (
                ("drafter", DrafterActor, drafters, pools.drafter),
                ("prefill", PrefillActor, prefills, pools.prefill),
            ):
                names[pool] = [f"{pool}-{i}" for i in range(settings.replicas)]
                if names[pool]:
                    pg = _placed(pool, len(names[pool]), settings.resources, "SPREAD")
                    groups.append(pg)
                    args = [(plain, name) for name in names[pool]]
                    actors += _actors_in(
                        pg, body, names[pool], settings.resources, args, max_restarts=-1
                    )
                    ray.get([a.info.remote() for a in actors], timeout=300)
            drafter_names, prefill_names = names["drafter"], names["prefill"]
            verifier_names: list[str] = []
            tp = pools.verifier.tensor_parallel_size
            for g in range(pools.verifier.groups):
                # One bundle per rank, packed: a group's ranks share a node where they fit.
                pg = _placed("verifier", tp, pools.verifier.resources, "PACK")
                groups.append(pg)
                rank_names = [f"verifier-g{g}-r{r}" for r in range(1, tp)]
                ranks += _actors_in(
                    pg,
                    VerifierRankActor,
                    rank_names,
                    pools.verifier.resources,
                    [(plain, name, r, tp) for r, name in enumerate(rank_names, start=1)],
                    first_bundle=1,
                    max_restarts=-1,  # their rank 0 restarts them (cluster/verifier.py)
                )
                # Each verifier group drafts and prefills with its share of those pools.
                name = f"verifier-g{g}-r0"
                mine = drafter_names[g :: pools.verifier.groups]
                my_prefills = prefill_names[g :: pools.verifier.groups]
                verifiers += _actors_in(
                    pg,
                    VerifierActor,
                    [name],
                    pools.verifier.resources,
                    [(plain, name, mine, my_prefills, rank_names)],
                    max_concurrency=1000,
                    max_restarts=-1,  # a group recovers as a whole (cluster/verifier.py)
                )
                verifier_names.append(name)
            ray.get([v.info.remote() for v in verifiers], timeout=300)
        except BaseException:
            partial = cls(config, verifiers, [], drafters, [], groups, owns, prefills, [], ranks)
            partial.shutdown()
            raise
        return cls(
            config,
            verifiers,
            verifier_names,
            drafters,
            drafter_names,
            groups,
            owns,
            prefills,
            prefill_names,
            ranks,
            detached=lifetime == "detached",
        )

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec | None = None,
        request_id: str | None = None,
        group: int | None = None,
    ) -> RequestStream:
        """Start a request on verifier group `group` (round-robin when None; the router picks
        by cached prefix and load)."""
        with self._lock:
            if group is None:
                group = self._next % len(self.verifiers)
                self._next += 1
            request_id = request_id or f"req-{next(self._ids)}-{time.time_ns()}"
        index = group
        spec = spec or RequestSpec()
        span = telemetry.tracer().start_span("outrider.request")
        span.set_attributes(
            {
                "outrider.request_id": request_id,
                "outrider.verifier": self.verifier_names[index],
                "outrider.prompt_tokens": len(prompt_ids),
            }
        )
        carrier = telemetry.inject(span)
        generator = (
            self.verifiers[index]
            .generate.options(num_returns="streaming")
            .remote(request_id, list(prompt_ids), params, spec, carrier)
        )
        return RequestStream(request_id, self.verifier_names[index], generator, span)

    def abort(self, stream: RequestStream) -> None:
        import ray

        ray.cancel(stream.generator)

    async def load(self) -> list[LoopLoad]:
        """Each verifier group's queue depth and KV usage."""
        return list(await asyncio.gather(*(v.load.remote() for v in self.verifiers)))

    def verifier_stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([v.stats.remote() for v in self.verifiers])

    def metrics_url(self) -> str:
        """Ray's Prometheus endpoint on the head node, where the actors' engine metrics are
        (cluster/engine_metrics.py); every node serves its own actors' on its port."""
        import ray

        head = next((n for n in ray.nodes() if n.get("Alive")), ray.nodes()[0])
        return f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"

    def actor_info(self) -> dict[str, list[dict[str, Any]]]:
        import ray

        return {
            "verifiers": ray.get([v.info.remote() for v in self.verifiers]),
            "drafters": ray.get([d.info.remote() for d in self.drafters]),
            "prefill": ray.get([p.info.remote() for p in self.prefills]),
        }

    def shutdown(self, stop_pools: bool | None = None) -> None:
        """Stop the pools (by default only those this runtime started for itself: pools it
        attached to, or started detached for a cluster it joined, stay for the other router
        replicas) and, if it started Ray, Ray."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if stop_pools is None:
            stop_pools = not (self.attached or self.detached)
        if stop_pools:
            for actor in [*self.verifiers, *self.ranks, *self.drafters, *self.prefills]:
                ray.kill(actor, no_restart=True)
            for pg in self.placement_groups:
                remove_placement_group(pg)
        if self.owns_ray:
            ray.shutdown()

    @classmethod
    def attach(cls, config: DeploymentConfig) -> Runtime | None:
        """The pools another process started on this Ray cluster (router replicas share one
        deployment), or None when there are none yet."""
        import ray

        def lookup(name: str) -> Any:
            return ray.get_actor(name, namespace=RAY_NAMESPACE)

        pools = config.pools
        verifier_names = [f"verifier-g{g}-r0" for g in range(pools.verifier.groups)]
        try:
            verifiers = [lookup(n) for n in verifier_names]
        except ValueError:
            return None
        infos = ray.get([v.info.remote() for v in verifiers], timeout=60)
        differ = settings_differ(config.pool_settings(), infos[0]["pool_settings"])
        if differ:
            log.warning(
                "the running pools were started with other settings (%s) than this config; "
                "they are served as they are. To apply the config, stop the pools (docs/"
                "operations.md, Changing a running deployment).",
                ", ".join(differ),
            )
        drafter_names = [n for i in infos for n in i["drafters"]]
        prefill_names = [n for i in infos for n in i["prefill"]]
        rank_names = [n for i in infos for n in i["ranks"]]
        return cls(
            config,
            verifiers,
            verifier_names,
            [lookup(n) for n in drafter_names],
            drafter_names,
            [],
            False,
            [lookup(n) for n in prefill_names],
            prefill_names,
            [lookup(n) for n in rank_names],
            attached=True,
        )
