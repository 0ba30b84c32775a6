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
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cluster import ngram_pool, telemetry
from cluster.config import DeploymentConfig, Resources, from_dict
from cluster.links import TensorLink, backend_for
from cluster.prefill import PrefillWorker, plan_for, receive
from cluster.remote_drafting import DrafterWorker, RemoteDrafter, ShardedDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.engine_loop import LoopLoad
from workers.engine.llm_engine import Prefilled, RequestOutput
from workers.engine.model_runner import ModelRunner, RunnerOutput, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats
from workers.kv_cache import PagedKVCache
from workers.model.tensor_parallel import build_sharded_model

RAY_NAMESPACE = "outrider"
DRAFT_DEADLINE_S = 1.0


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


def _engine_config(config: DeploymentConfig) -> EngineConfig:
    spec = SpecConfig(
        method=config.speculative.method,
        num_speculative_tokens=config.speculative.num_speculative_tokens,
        adaptive=config.speculative.adaptive,
    )
    return EngineConfig(
        max_model_len=config.engine.max_model_len,
        max_num_seqs=config.engine.max_num_seqs,
        block_size=config.engine.block_size,
        spec=spec,
    )


def _model_spec(config: DeploymentConfig) -> Any:
    from workers.engine.factory import ModelSpec

    drafter = config.pools.drafter
    return ModelSpec(config.model, config.dtype, drafter.draft_model, drafter.draft_layers)


def _use_assigned_cpus() -> None:
    """Torch threads = the CPUs Ray gave this actor (at least one)."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))


def _where() -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "pid": os.getpid()}


class DrafterActor:
    """Ray actor body of a drafter (wrapped with `ray.remote` in `Runtime`)."""

    def __init__(self, config: dict[str, Any], name: str) -> None:
        import torch

        from workers.engine.factory import build_drafters
        from workers.model.loader import build_model, load_checkpoint, parse_dtype

        torch.set_num_threads(1)
        deployment = from_dict(config)
        method = deployment.pools.drafter.method
        spec = _model_spec(deployment)

        def make() -> Any:
            checkpoint = load_checkpoint(deployment.model)
            target = build_model(checkpoint, dtype=parse_dtype(deployment.dtype))
            engine_config = _engine_config(deployment)
            drafters, costs = build_drafters(
                spec, engine_config, checkpoint, target, progress=False, only=method
            )
            self.cost = costs.get(method, 0.0)
            return drafters[method]

        self.cost = 0.0
        self.worker = DrafterWorker(make, name)

    def info(self) -> dict[str, Any]:
        return {**self.worker.info(), "cost": self.cost, **_where()}

    def open_link(self, address: Any) -> int:
        return self.worker.open_link(address)

    def step(self, message: Any) -> Any:
        return self.worker.step(message)


class PrefillActor:
    """Ray actor body of a prefill worker."""

    def __init__(self, config: dict[str, Any], name: str) -> None:

        from workers.model.loader import build_model, load_checkpoint, parse_dtype

        _use_assigned_cpus()
        deployment = from_dict(config)
        self.name = name
        model = build_model(load_checkpoint(deployment.model), dtype=parse_dtype(deployment.dtype))
        self.worker = PrefillWorker(
            model, deployment.engine.max_model_len, deployment.engine.block_size
        )

    def info(self) -> dict[str, Any]:
        return {"name": self.name, **_where()}

    def open_link(self, address: Any) -> None:
        self.worker.open_link(address)

    def prefill(self, token_ids: list[int], hidden_layers: list[int]) -> dict[str, Any]:
        return self.worker.prefill(token_ids, hidden_layers)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the other ranks of a verifier group replay each step (plain data)."""

    block_copies: list[tuple[int, int]]
    seqs: list[SeqForward]


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: before each forward, the batch plan goes to the other ranks (in order,
    one Ray call each, not awaited); the forward's all-reduces keep the ranks in step."""

    def __init__(self, runner: ModelRunner, ranks: list[Any]) -> None:
        super().__init__(runner.model, runner.kv_cache)
        self.ranks = ranks
        self._copies: list[tuple[int, int]] = []
        self._pending: list[Any] = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._copies += copies
        super().copy_blocks(copies)

    def forward(
        self,
        seqs: Sequence[SeqForward],
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
    ) -> RunnerOutput:
        import ray

        # The other ranks need no logits: only rank 0 samples.
        plan = StepPlan(self._copies, [replace(s, num_logits=0) for s in seqs])
        self._copies = []
        self._pending = [r for r in self._pending if not _done(r)]
        self._pending += [rank.step.remote(plan) for rank in self.ranks]
        if len(self._pending) > 64 * len(self.ranks):  # a rank fell far behind, or failed
            ray.get(self._pending.pop(0), timeout=60)
        return super().forward(seqs, hidden_layers, return_final_hidden)


def _done(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    if ready:
        ray.get(ref)  # raises what the rank raised
    return bool(ready)


class VerifierRankActor:
    """Ray actor body of rank r > 0 of a tensor-parallel verifier group: its slice of the
    target and of the KV cache; it replays rank 0's batch plans."""

    def __init__(self, config: dict[str, Any], name: str, rank: int, world: int) -> None:

        from workers.model.loader import load_checkpoint, parse_dtype

        _use_assigned_cpus()
        deployment = from_dict(config)
        self.name, self.rank, self.world = name, rank, world
        checkpoint = load_checkpoint(deployment.model)
        model = build_sharded_model(checkpoint, rank, world, None, parse_dtype(deployment.dtype))
        blocks = _engine_config(deployment).kv_blocks
        block_size = deployment.engine.block_size
        cache = PagedKVCache(model.config, blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        self.link: TensorLink | None = None

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, **_where()}

    def join_group(self, address: Any) -> None:
        self.link = TensorLink.join(address, timeout_s=60.0, rank=self.rank)
        self.runner.model.reduce = self.link.all_reduce

    def step(self, plan: StepPlan) -> None:
        self.runner.copy_blocks(plan.block_copies)
        self.runner.forward(plan.seqs)


class VerifierActor:
    """Ray actor body of a verifier: rank 0 of its group, which runs the engine."""

    def __init__(
        self,
        config: dict[str, Any],
        name: str,
        drafter_names: list[str],
        prefill_names: list[str] | None = None,
        rank_names: list[str] | None = None,
    ) -> None:
        import ray

        from workers.engine.engine_loop import EngineLoop
        from workers.engine.factory import build_engine

        _use_assigned_cpus()
        deployment = from_dict(config)
        self.name = name
        _setup_tracing(deployment)
        self.rounds = telemetry.RoundTracer()
        remote: dict[str, tuple[Any, float]] = {}
        self.drafter_names = drafter_names
        self.drafters: ShardedDrafter | None = None
        if drafter_names:
            actors = [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in drafter_names]
            infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in actors])
            shards = [
                RemoteDrafter(a, i["method"], i["hidden_layers"], DRAFT_DEADLINE_S, n)
                for a, i, n in zip(actors, infos, drafter_names, strict=True)
            ]
            self.drafters = ShardedDrafter(shards)
            remote[infos[0]["method"]] = (self.drafters, max(i["cost"] for i in infos))
        self.rank_names = list(rank_names or [])
        world = 1 + len(self.rank_names)
        loaded = build_engine(
            _model_spec(deployment),
            _engine_config(deployment),
            False,
            remote,
            lambda checkpoint, dtype: build_sharded_model(checkpoint, 0, world, None, dtype),
        )
        if world > 1:
            self._join_group(loaded.engine, world)
        self.tokenizer = loaded.tokenizer
        self.ngram_pool = ngram_pool.follow(
            loaded.engine.speculator.drafters,
            deployment.redis.connection_url(),
            deployment.redis.password(),
        )
        loaded.engine.step_listeners.append(self.rounds)
        self.loop = EngineLoop(loaded.engine)
        self.dtype = deployment.dtype
        self.min_remote_prompt = deployment.pools.prefill.min_remote_prompt_tokens
        # Remote prefill writes whole-model K/V; a tensor-parallel group prefills itself.
        self.prefill_names = list(prefill_names or []) if world == 1 else []
        self.prefill_actors = [
            ray.get_actor(n, namespace=RAY_NAMESPACE) for n in self.prefill_names
        ]
        self.prefill_links: list[TensorLink | None] = [None] * len(self.prefill_names)
        self.prefill_locks = [asyncio.Lock() for _ in self.prefill_names]
        self.prefill_stats: dict[str, float] = {
            "remote": 0,
            "local": 0,
            "failures": 0,
            "bytes": 0,
            "compute_s": 0.0,
            "transfer_s": 0.0,
        }
        self._next_prefill = 0
        self._prefilled_by: dict[str, str] = {}

    def _join_group(self, engine: Any, world: int) -> None:
        """Build the group over this verifier's ranks and make rank 0's forwards lead it."""
        import ray

        ranks = [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in self.rank_names]
        backend = backend_for(engine.runner.model.device)  # NCCL for CUDA ranks
        group = TensorLink.host(f"{self.name}-tp", backend, timeout_s=60.0, world=world)
        joined = [r.join_group.remote(group.address) for r in ranks]
        group.connect()
        ray.get(joined, timeout=120)
        engine.runner.model.reduce = group.all_reduce
        engine.runner = TensorParallelRunner(engine.runner, ranks)
        self.group = group

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "drafters": self.drafter_names,
            "prefill": self.prefill_names,
            "ranks": self.rank_names,
            **_where(),
        }

    def _served_by(self, request_id: str) -> ServedBy:
        drafter = None if self.drafters is None else self.drafters.owner_name(request_id)
        prefill = self._prefilled_by.pop(request_id, None)
        return ServedBy(prefill, [self.name, *self.rank_names], drafter)

    def _prefill_link(self, index: int) -> TensorLink:
        """The link to prefill worker `index`, (re)built when missing or broken."""
        import ray

        link = self.prefill_links[index]
        if link is None or not link.connected:
            link = TensorLink.host(f"{self.name}-{self.prefill_names[index]}", timeout_s=120.0)
            joined: Any = self.prefill_actors[index].open_link.remote(link.address)
            link.connect()
            ray.get(joined, timeout=60)
            self.prefill_links[index] = link
        return link

    async def _remote_prefill(
        self, request_id: str, prompt_ids: list[int], spec: RequestSpec, carrier: Any
    ) -> Prefilled | None:
        """The prompt but its last token, computed by a prefill worker; None to prefill here
        (no worker, or fewer than `min_remote_prompt_tokens` tokens left to compute once the
        prefix cache has given what it holds)."""
        engine = self.loop.engine
        uncached = len(prompt_ids) - 1 - engine.cached_prefix_tokens(prompt_ids)
        if not self.prefill_actors or uncached < max(1, self.min_remote_prompt):
            self.prefill_stats["local"] += 1
            return None
        try:
            method, _ = engine.speculator.resolve(spec)
        except ValueError:
            return None  # the engine rejects the request itself, with the message
        drafter = engine.speculator.drafters.get(method)
        layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        index = self._next_prefill % len(self.prefill_actors)
        self._next_prefill += 1
        plan = plan_for(engine.runner.model.config, len(prompt_ids) - 1, layers, self.dtype)
        span = telemetry.tracer().start_span(
            "outrider.kv_transfer", context=telemetry.extract(carrier)
        )
        loop = asyncio.get_running_loop()
        try:
            async with self.prefill_locks[index]:
                link = await loop.run_in_executor(None, self._prefill_link, index)
                ref: Any = self.prefill_actors[index].prefill.remote(prompt_ids[:-1], layers)
                kv, hidden = await loop.run_in_executor(None, receive, link, plan)
                timing = await ref
        except Exception:
            self.prefill_stats["failures"] += 1
            self.prefill_links[index] = None
            span.end()
            return None
        span.set_attributes(
            {
                "outrider.request_id": request_id,
                "outrider.prefill_worker": self.prefill_names[index],
                "outrider.prefill_tokens": plan.num_tokens,
                "outrider.bytes_moved": timing["bytes"],
                "outrider.prefill.compute_s": round(timing["compute_s"], 6),
                "outrider.prefill.transfer_s": round(timing["transfer_s"], 6),
            }
        )
        span.end()
        self.prefill_stats["remote"] += 1
        self.prefill_stats["bytes"] += timing["bytes"]
        self.prefill_stats["compute_s"] += timing["compute_s"]
        self.prefill_stats["transfer_s"] += timing["transfer_s"]
        self._prefilled_by[request_id] = self.prefill_names[index]
        return Prefilled(kv, hidden or None)

    def load(self) -> LoopLoad:
        """Queue depth and KV usage, for the router's load-aware choice."""
        return self.loop.load()

    def stats(self) -> dict[str, Any]:
        engine_stats = self.loop.engine.stats
        return {
            "spec": engine_stats.as_dict(),
            "remote_drafting": None if self.drafters is None else asdict(self.drafters.stats),
            "prefill": dict(self.prefill_stats),
        }

    def finished_spans(self) -> list[dict[str, Any]]:
        return telemetry.finished_spans()

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec,
        trace_carrier: dict[str, str] | None = None,
    ) -> AsyncIterator[StepMessage]:
        """Streams one message per engine step that produced something for the request."""
        self.rounds.start(request_id, trace_carrier)
        prefilled = await self._remote_prefill(request_id, prompt_ids, spec, trace_carrier)
        outputs = self.loop.stream(request_id, prompt_ids, params, spec, prefilled)
        try:
            async for out in outputs:
                served_by = self._served_by(request_id) if out.finished else None
                yield StepMessage(out, served_by)
        finally:
            # Cancelled (the client is gone) or failed: closing the stream aborts the request
            # in the engine and frees its blocks.
            await outputs.aclose()
            self.rounds.finish(request_id)
            self._prefilled_by.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class ServedBy:
    """The actors that served a request."""

    prefill: str | None  # None: the verifier prefilled it itself
    verifier: list[str]  # the group's ranks
    drafter: str | None  # None: drafted in-process (model-free methods) or not at all


@dataclass(frozen=True, slots=True)
class StepMessage:
    """Verifier -> client: what one engine step produced for one request."""

    output: RequestOutput
    served_by: ServedBy | None = None  # with the last step


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

    def _items(self) -> Iterator[StepMessage]:
        import ray

        try:
            for ref in self.generator:
                yield self._record(ray.get(ref))
        finally:
            self._end_span()

    async def items_async(self) -> AsyncIterator[StepMessage]:
        """The verifier's messages, for asyncio callers (the router)."""
        try:
            async for ref in self.generator:
                yield self._record(await ref)
        finally:
            self._end_span()

    def _record(self, message: StepMessage) -> StepMessage:
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


def _setup_tracing(config: DeploymentConfig) -> None:
    t = config.telemetry
    telemetry.setup_tracing(t.exporter, t.otlp_endpoint, t.service_name)


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
        _setup_tracing(config)
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

    def actor_info(self) -> dict[str, list[dict[str, Any]]]:
        import ray

        return {
            "verifiers": ray.get([v.info.remote() for v in self.verifiers]),
            "drafters": ray.get([d.info.remote() for d in self.drafters]),
            "prefill": ray.get([p.info.remote() for p in self.prefills]),
        }

    def shutdown(self) -> None:
        """Stop the pools this runtime started (a runtime that attached to running pools
        leaves them to the others) and, if it started Ray, Ray."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not self.attached:
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
