"""Starting the pools of a deployment on Ray, and finding pools already running: one placement
group per pool and the named actors in it.

- `drafter-<i>`: a drafter actor running the pool's drafting method (CPU, plus any custom
  resource such as `grace_cpu` that the config names, so drafters land on the Grace CPU beside
  a GPU on GB200 nodes). Restarted by Ray if it dies; its verifier re-adds its sequences.
- `prefill-<i>`: a prefill worker computing prompts' K/V (and EAGLE features) and sending them
  to the verifier over a tensor link.
- `verifier-g<g>-r0` (and `-r1`... for tensor parallelism): the engine (continuous batching,
  verification) with model-free drafters in-process and the drafter pool behind
  `RemoteDrafter`s.

The request path over them is cluster/runtime.py.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.actors import RAY_NAMESPACE, DrafterActor, PrefillActor, VerifierRankActor
from cluster.config import DeploymentConfig, Resources, settings_differ
from cluster.verifier import VerifierActor

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pools:
    """A deployment's actors (Ray actor handles) by pool, with their names."""

    verifiers: list[Any] = field(default_factory=list)  # rank 0 of each group
    verifier_names: list[str] = field(default_factory=list)
    drafters: list[Any] = field(default_factory=list)
    drafter_names: list[str] = field(default_factory=list)
    prefills: list[Any] = field(default_factory=list)
    prefill_names: list[str] = field(default_factory=list)
    ranks: list[Any] = field(default_factory=list)  # verifier ranks > 0
    placement_groups: list[Any] = field(default_factory=list)
    attached: bool = False  # found running, started by another process (which stops them)
    # Started for a cluster this process joined (a router replica): Ray's detached actors,
    # which outlive it, for the other replicas.
    detached: bool = False

    @property
    def actors(self) -> list[Any]:
        return [*self.verifiers, *self.ranks, *self.drafters, *self.prefills]

    def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Kill the actors, the verifiers' spans flushed first, and free their placement
        groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        flushes = [v.flush_telemetry.remote() for v in self.verifiers]
        try:
            ray.get(flushes, timeout=flush_timeout_s)
        except Exception:  # a dead or stuck verifier: its spans are lost, not the shutdown
            log.warning("a verifier's spans were not flushed before it stopped", exc_info=True)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)


def connect_ray(config: DeploymentConfig, address: str | None, num_cpus: int | None) -> bool:
    """Join the cluster at `address`, or start a local one (with the dashboard) when None;
    whether this process started it (then it stops it too). A local cluster gets at least the
    CPUs its pools ask for: on a small machine the actors share cores (logical CPUs), which is
    what a laptop deployment wants."""
    import ray

    if ray.is_initialized():
        return False
    if address is None and num_cpus is None:
        num_cpus = max(os.cpu_count() or 1, math.ceil(resources_needed(config)["CPU"]))
    if address is None:
        quiet_log_monitor()
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
            return True
        except ValueError as err:
            # A cluster this process just shut down can hold the dashboard port for a moment.
            if "already occupied" not in str(err) or attempt == 2:
                raise
            ray.shutdown()
            time.sleep(3.0)
        except ConnectionError as err:
            # Ray Client's proxy starts a server process per client, which now and then dies
            # as it starts ("Initialization failure from server"); the next one comes up.
            if not (address or "").startswith("ray://") or attempt == 2:
                raise
            log.warning("joining %s failed, trying again: %s", address, err)
            ray.shutdown()
            time.sleep(1.0)
    raise AssertionError("unreachable")


def quiet_log_monitor() -> None:
    """A local cluster's log monitor forwards the workers' log lines to drivers that ask for
    them, which Outrider's do not (`log_to_driver=False`; the dashboard reads the log files
    itself). Left as it is, it globs the session's log folder ten times a second, about 4 ms of
    CPU a second that a small host takes from the engine; this has it look for new files every
    5 s (both settings are read by the log monitor ray.init starts, and one set in the
    environment is kept)."""
    os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
    os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")


def start_pools(
    config: DeploymentConfig, detached: bool = False, placement_timeout_s: float = 120.0
) -> Pools:
    """Place the pools and start their actors (`config`'s GPUs decided: `resolve_gpus`); each
    verifier group drafts and prefills with its share of the drafter and prefill pools. Pools
    started from a process that joined a cluster (a router replica) must outlive it:
    `detached`. On failure, whatever started is stopped before the error is raised."""
    import ray

    started = Pools(detached=detached)
    placer = _Placer("detached" if detached else None, placement_timeout_s, config.to_dict())
    pools = config.pools
    try:
        # Every pool's actors are created at once, so that their processes start (imports, the
        # model's load) side by side. A verifier waits in its own start for its drafters to be
        # up (it asks them what they draft, and how fast) before it builds its engine.
        # Drafters and prefill workers: one actor per bundle, spread over nodes.
        for pool, body, actors, names, settings in (
            ("drafter", DrafterActor, started.drafters, started.drafter_names, pools.drafter),
            ("prefill", PrefillActor, started.prefills, started.prefill_names, pools.prefill),
        ):
            names += [f"{pool}-{i}" for i in range(settings.replicas)]
            if names:
                pg = placer.group(pool, len(names), settings.resources, "SPREAD")
                started.placement_groups.append(pg)
                actors += placer.actors(pg, body, names, settings.resources, max_restarts=-1)
        tp = pools.verifier.tensor_parallel_size
        for g in range(pools.verifier.groups):
            # One bundle per rank, packed: a group's ranks share a node where they fit.
            pg = placer.group("verifier", tp, pools.verifier.resources, "PACK")
            started.placement_groups.append(pg)
            rank_names = [f"verifier-g{g}-r{r}" for r in range(1, tp)]
            started.ranks += placer.actors(
                pg,
                VerifierRankActor,
                rank_names,
                pools.verifier.resources,
                [(r, tp) for r in range(1, tp)],
                first_bundle=1,
                max_restarts=-1,  # their rank 0 restarts them (cluster/verifier.py)
            )
            name = f"verifier-g{g}-r0"
            mine = started.drafter_names[g :: pools.verifier.groups]
            my_prefills = started.prefill_names[g :: pools.verifier.groups]
            started.verifiers += placer.actors(
                pg,
                VerifierActor,
                [name],
                pools.verifier.resources,
                [(mine, my_prefills, rank_names)],
                max_concurrency=1000,
                max_restarts=-1,  # a group recovers as a whole (cluster/verifier.py)
            )
            started.verifier_names.append(name)
        # A drafter or prefill worker that cannot start fails the start-up here, at once (its
        # verifier would wait for it).
        ray.get([a.info.remote() for a in [*started.drafters, *started.prefills]], timeout=300)
        ray.get([v.info.remote() for v in started.verifiers], timeout=300)
    except BaseException:
        started.stop()
        raise
    return started


def attach_pools(config: DeploymentConfig) -> Pools | None:
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
    return Pools(
        verifiers,
        verifier_names,
        [lookup(n) for n in drafter_names],
        drafter_names,
        [lookup(n) for n in prefill_names],
        prefill_names,
        [lookup(n) for n in rank_names],
        attached=True,
    )


@dataclass(frozen=True, slots=True)
class _Placer:
    """Placement groups and the named actors in them, for one start-up. Every actor is
    constructed with the deployment config and its name first, then its own arguments."""

    lifetime: str | None  # "detached": the actors outlive the process that started them
    timeout_s: float
    config: dict[str, Any]  # the deployment config, as plain data

    def group(self, pool: str, count: int, resources: Resources, strategy: str) -> Any:
        from ray.util.placement_group import placement_group

        bundles = [_bundle(resources)] * count
        pg = placement_group(bundles, strategy=strategy, lifetime=self.lifetime)
        _wait_placed(pg, pool, bundles, self.timeout_s)
        return pg

    def actors(
        self,
        pg: Any,
        body: type,
        names: list[str],
        resources: Resources,
        args: list[tuple[Any, ...]] | None = None,
        first_bundle: int = 0,
        **options: Any,
    ) -> list[Any]:
        """Named actors of `body`, one per bundle of `pg` from `first_bundle` on; actor i gets
        `args[i]` after the config and its name."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls: Any = ray.remote(body)
        extra = args or [()] * len(names)
        return [
            actor_cls.options(
                name=name,
                namespace=RAY_NAMESPACE,
                lifetime=self.lifetime,
                num_cpus=resources.cpus,
                num_gpus=resources.gpus,
                resources=dict(resources.custom),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, first_bundle + i),
                **options,
            ).remote(self.config, name, *own)
            for i, (name, own) in enumerate(zip(names, extra, strict=True))
        ]


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


def resources_needed(config: DeploymentConfig) -> dict[str, float]:
    """What every pool's bundles ask for together, by Ray resource name."""
    pools = config.pools
    verifier_ranks = pools.verifier.groups * pools.verifier.tensor_parallel_size
    needed: dict[str, float] = {"CPU": 0.0}
    for count, resources in (
        (pools.prefill.replicas, pools.prefill.resources),
        (verifier_ranks, pools.verifier.resources),
        (pools.drafter.replicas, pools.drafter.resources),
    ):
        for name, amount in _bundle(resources).items():
            needed[name] = needed.get(name, 0.0) + count * amount
    return needed


def check_fits(config: DeploymentConfig, cluster: dict[str, float]) -> None:
    """Fail at once where the pools ask for more than a cluster that cannot grow has (one
    this process started: no autoscaler adds a node to it), rather than after the placement
    timeout."""
    short = {
        name: (amount, cluster.get(name, 0.0))
        for name, amount in resources_needed(config).items()
        if amount > cluster.get(name, 0.0) + 1e-9
    }
    if short:
        raise PlacementError(
            "the pools ask for more than this local Ray cluster has: "
            + ", ".join(f"{n} {need:g} (it has {have:g})" for n, (need, have) in short.items())
            + "; start it with more CPUs (Runtime.start's num_cpus) or ask for fewer replicas "
            "or smaller resources"
        )


def _bundle(resources: Resources) -> dict[str, float]:
    bundle = {"CPU": resources.cpus, **resources.custom}
    if resources.gpus:
        bundle["GPU"] = resources.gpus
    return bundle
