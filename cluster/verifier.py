"""The verifier actor: rank 0 of a verifier group, which runs the engine (continuous batching
and verification), drafts through the drafter pool, prefills through the prefill pool
(cluster/prefill_client.py), and sends each request's steps to its client as typed messages,
a step's for all of that client's requests in one message of its output channel
(cluster/output_channel.py).

Ray restarts a verifier that dies (its process killed, its node lost), and a group recovers as
a whole: a rank 0 that lost a rank of its tensor-parallel group, or whose forward failed part-way
(the ranks are out of step), ends its own process, and a restarted rank 0 restarts its other
ranks before it forms the group again. Its requests fail with the actor (the router answers
503); its drafters and prefill workers take the new links it opens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from cluster import logs, ngram_pool, telemetry
from cluster.actors import (
    DRAFT_DEADLINE_S,
    RAY_NAMESPACE,
    RankFailed,
    TensorParallelRunner,
    assigned_device,
    info_when_up,
    start_tracing,
    use_assigned_cpus,
    where,
)
from cluster.config import from_dict
from cluster.engine_metrics import ActorMetrics, VerifierMetrics
from cluster.links import TensorLink, link_backend
from cluster.output_channel import Batch, ClientChannel, ServedBy, StreamedStep, close_silent
from cluster.output_socket import Address, OutputServer
from cluster.prefill_client import PrefillClient
from cluster.remote_drafting import RemoteDrafter, ShardedDrafter
from cluster.step_channel import ChannelAddress, StepClient
from workers.engine.config import RequestSpec
from workers.engine.engine_loop import LoopLoad
from workers.engine.fair_share import DEFAULT_SHARE, Share
from workers.engine.heap import freeze_startup_heap
from workers.engine.outputs import Continuation, RequestOutput, StepReport
from workers.engine.sampling_params import SamplingParams
from workers.model.tensor_parallel import build_sharded_model, split_evenly

log = logging.getLogger(__name__)
# How long a (restarted) verifier waits for each actor it needs that is restarting too (a
# drafter on the same lost node, its other ranks): their models load first.
RESTART_TIMEOUT_S = 600.0


@dataclass(slots=True)
class StepTimes:
    """Where the verifier's engine steps spend their time (an engine step listener)."""

    steps: int = 0
    draft_s: float = 0.0  # waiting for drafts (remote drafters: the step's hand-off included)
    forward_s: float = 0.0  # the target's forwards with verification
    verify_steps: int = 0  # steps that verified (a sequence decoding), and their forwards
    verify_forward_s: float = 0.0

    def __call__(self, report: StepReport) -> None:
        self.steps += 1
        self.draft_s += report.draft_s
        self.forward_s += report.forward_s
        if report.verified:
            self.verify_steps += 1
            self.verify_forward_s += report.forward_s


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

        use_assigned_cpus()
        deployment = from_dict(config)
        logs.configure(deployment.router.log_format)
        self.pool_settings = deployment.pool_settings()  # what a router that attaches checks
        self.name = name
        self.device = assigned_device()
        start_tracing(deployment)
        self.rounds = telemetry.RoundTracer()
        remote: dict[str, tuple[Any, float]] = {}
        self.drafter_names = drafter_names
        self.drafters: ShardedDrafter | None = None
        if drafter_names:
            actors = [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in drafter_names]
            infos = [info_when_up(a, RESTART_TIMEOUT_S) for a in actors]
            # A pool the default method does not use is linked to when a request asks for it.
            by_default = infos[0]["method"] == deployment.speculative.method
            shards = [
                RemoteDrafter(
                    a,
                    i["method"],
                    i["hidden_layers"],
                    DRAFT_DEADLINE_S,
                    n,
                    link_backend(self.device, i["device"]),
                    connect=by_default,
                )
                for a, i, n in zip(actors, infos, drafter_names, strict=True)
            ]
            for shard, i in zip(shards, infos, strict=True):  # what each drafter can do
                shard.drafts_trees, shard.tree_seconds = i["drafts_trees"], i["tree_seconds"]
            self.drafters = ShardedDrafter(shards)
            remote[infos[0]["method"]] = (self.drafters, max(i["token_seconds"] for i in infos))
        self.rank_names = list(rank_names or [])
        world = 1 + len(self.rank_names)
        settings = deployment.engine_config()
        if world > 1:
            # The group's all-reduces are joined after the engine is built (its graphs would
            # be captured without them), and a gloo all-reduce cannot be captured at all.
            settings = replace(settings, enforce_eager=True)
        loaded = build_engine(
            deployment.model_spec(self.device),
            settings,
            False,
            remote,
            lambda ck, dtype: build_sharded_model(ck, 0, world, None, dtype, self.device),
        )
        # The whole model's config: a prefill worker sends every KV head (the engine's model
        # is this rank's slice of them).
        self.model_config = loaded.model_config
        if world > 1:
            self._join_group(loaded.engine, world)
        self.tokenizer = loaded.tokenizer
        self.ngram_pool = ngram_pool.follow(
            loaded.engine.speculator.drafters,
            deployment.redis.connection_url(),
            deployment.redis.password(),
        )
        loaded.engine.step_listeners.append(self.rounds)
        self.step_times = StepTimes()
        loaded.engine.step_listeners.append(self.step_times)
        self.prefills = PrefillClient(
            name,
            list(prefill_names or []),
            deployment.pools.prefill,
            self.model_config,
            deployment.dtype,
            self.device,
        )
        self.metrics = VerifierMetrics(
            ActorMetrics("verifier", name), loaded.engine, self.drafters, self.prefills.stats
        )
        self.metrics.metrics.count_restart()
        loaded.engine.step_listeners.append(self.metrics)
        self.metrics.start_sampling()
        # On the CPU the engine thread's step is the host's work: a step's outputs are made
        # into text and sent to each client's connection there, once a step, for less than
        # a wake-up of this actor's event loop and the interpreter lock's way to it and back
        # cost (cluster/output_socket.py's DirectSender). A GPU's engine thread keeps to
        # launching steps, and hands its outputs to the event loop.
        self._outputs_on_engine_thread = self.device == "cpu"
        # Each client's output channel (cluster/output_channel.py), by its id: there before
        # the engine loop's thread, which hands its outputs over to them from its first turn
        self.channels: dict[str, ClientChannel] = {}
        handed_over = self._hand_over if self._outputs_on_engine_thread else None
        self.loop = EngineLoop(loaded.engine, self._fatal, handed_over)
        self._prefilled_by: dict[str, str] = {}
        self._dropped: set[str] = set()  # clients whose channel ended (ids are not reused)
        self._closing: asyncio.Task[None] | None = None  # closes the silent ones
        # Channels read over a connection of their own (cluster/output_socket.py)
        self.output_server = OutputServer(
            self._connected, self._drop, direct=self._outputs_on_engine_thread
        )
        # The requests waiting for a remote prefill, and those of them aborted meanwhile
        self._prefilling: set[str] = set()
        self._aborted: set[str] = set()
        freeze_startup_heap()

    def _join_group(self, engine: Any, world: int) -> None:
        """Build the group over this verifier's ranks and make rank 0's forwards lead it."""
        import ray

        ranks = [ray.get_actor(n, namespace=RAY_NAMESPACE) for n in self.rank_names]
        if ray.get_runtime_context().was_current_actor_reconstructed:
            _restart_ranks(ranks)
        backend = link_backend(engine.runner.model.device)  # NCCL for GPU ranks
        group = TensorLink.host(f"{self.name}-tp", backend, timeout_s=60.0, world=world)
        joined = [r.join_group.remote(group.address) for r in ranks]
        group.connect()
        addresses: list[ChannelAddress] = ray.get(joined, timeout=120)
        plans = [StepClient(address) for address in addresses]
        engine.runner.model.reduce = group.all_reduce
        kv_heads = split_evenly(self.model_config.num_kv_heads, world)
        engine.runner = TensorParallelRunner(engine.runner, plans, group, kv_heads)
        self.group = group

    def _fatal(self, exc: Exception) -> None:
        """The engine loop's hook for a step's exception: a broken tensor-parallel group ends
        this process, so that Ray restarts the group (this actor first)."""
        if isinstance(exc, RankFailed):
            log.error("%s: %s; restarting the group", self.name, exc)
            sys.stderr.flush()
            os._exit(1)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "drafters": self.drafter_names,
            "prefill": self.prefills.names,
            "ranks": self.rank_names,
            "device": self.device,
            "pool_settings": self.pool_settings,
            **where(),
        }

    def _served_by(self, request_id: str) -> ServedBy:
        drafter = None if self.drafters is None else self.drafters.owner_name(request_id)
        prefill = self._prefilled_by.pop(request_id, None)
        return ServedBy(prefill, [self.name, *self.rank_names], drafter)

    def load(self) -> LoopLoad:
        """Queue depth and KV usage, for the router's load-aware choice."""
        return self.loop.load()

    def stats(self) -> dict[str, Any]:
        engine_stats = self.loop.engine.stats
        return {
            "spec": engine_stats.as_dict(),
            "drafter_failures": dict(self.loop.engine.speculator.failures),
            "remote_drafting": None if self.drafters is None else asdict(self.drafters.stats),
            "prefill": dict(self.prefills.stats),
            "steps": asdict(self.step_times),
        }

    def flush_telemetry(self) -> bool:
        """Send the spans this actor has finished (before its pool stops it)."""
        return telemetry.flush_tracing()

    def finished_spans(self) -> list[dict[str, Any]]:
        return telemetry.finished_spans()

    async def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: RequestSpec,
        client: str,
        trace_carrier: dict[str, str] | None = None,
        continuation: Continuation | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> None:
        """Start a request (with `continuation`, one that moved here from a failed group); one
        message an engine step that produced something for it goes to `client`'s channel
        (`outputs`), and the error that refuses or fails it too. `share`: its tenant, weight
        and priority in the engine."""
        logs.REQUEST_ID.set(request_id)  # this call's task: its log lines name the request
        channel = self._channel(client)
        channel.requests.add(request_id)
        self.rounds.start(request_id, trace_carrier)
        prefilled = None
        # A scored prompt is computed here, every position; so is a continued request (its
        # last token is verified with drafts, not sampled from a prefill's logits).
        if params.prompt_logprobs is None and continuation is None:
            self._prefilling.add(request_id)
            try:
                remote = await self.prefills.prefill(
                    self.loop.engine, request_id, prompt_ids, spec, trace_carrier
                )
                if remote is not None:
                    prefilled, self._prefilled_by[request_id] = remote
            finally:
                self._prefilling.discard(request_id)
            if request_id in self._aborted:  # its client gave up meanwhile
                self._aborted.discard(request_id)
                self._ended(channel, request_id)
                return

        def consume(item: RequestOutput | Exception) -> None:
            if isinstance(item, Exception):
                channel.put(request_id, item)
                self._ended(channel, request_id)
                return
            served_by = self._served_by(request_id) if item.finished else None
            channel.put(request_id, StreamedStep(item, served_by))
            if item.finished:
                self._ended(channel, request_id)

        self.loop.start(
            request_id, prompt_ids, params, spec, prefilled, continuation, consume,
            share=share, on_loop_thread=self._outputs_on_engine_thread,
        )  # fmt: skip

    def _hand_over(self) -> None:
        """On the engine thread, once its outputs are handed over: each channel sends what
        they put in it (one message a client a step)."""
        for channel in list(self.channels.values()):
            channel.hand_over()

    def _ended(self, channel: ClientChannel, request_id: str) -> None:
        channel.requests.discard(request_id)
        self.rounds.finish(request_id)
        self._prefilled_by.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client gave up on it) and free its blocks."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self._prefilling:
            self._aborted.add(request_id)
        else:
            self.loop.abort(request_id)

    def _channel(self, client: str) -> ClientChannel:
        channel = self.channels.get(client)
        if channel is None:
            channel = self.channels[client] = ClientChannel()
        return channel

    async def until_closed(self, client: str) -> None:
        """Answers once client `client`'s channel has ended: a client reading it over a
        connection learns from this call's failure that the verifier died."""
        if client not in self._dropped:
            await self._channel(client).wait_closed()

    async def keep_alive(self, client: str) -> None:
        """Client `client` is alive (its stream stays open while it says so)."""
        channel = self.channels.get(client)
        if channel is not None:
            channel.seen = time.monotonic()

    async def outputs(self, client: str) -> AsyncIterator[Batch]:
        """Client `client`'s channel: its requests' outputs, one message for all of them an
        engine step. When the stream ends (closed, or its client is gone) so do they."""
        channel = self._opened(client)
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            self._drop(client, channel)

    async def poll_outputs(self, client: str, wait_s: float) -> Batch | None:
        """`outputs` for a client without streaming calls (Ray Client): what its requests
        produced since its last poll, waiting up to `wait_s` for something; None once its
        channel is closed (its requests ended then). A poll says the client is alive."""
        if client in self._dropped:
            return None
        channel = self._opened(client)
        channel.seen = time.monotonic()
        batch = await channel.take(wait_s)
        if batch is None:
            self._drop(client, channel)
        return batch

    async def outputs_address(self) -> Address:
        """Where a client reads its channel over a connection of its own instead of `outputs`
        (cluster/output_socket.py): this node's address, a port, and the secret to open with."""
        import ray

        return await self.output_server.address(ray.util.get_node_ip_address())

    def _connected(self, client: str) -> ClientChannel | None:
        """The channel of a client that connected to the output server (None: it ended)."""
        return None if client in self._dropped else self._opened(client)

    def _opened(self, client: str) -> ClientChannel:
        if self._closing is None:
            self._closing = asyncio.create_task(close_silent(self.channels, self._drop))
        return self._channel(client)

    def _drop(self, client: str, channel: ClientChannel) -> None:
        """A channel's end: its requests are aborted (again is a no-op)."""
        channel.close()
        if self.channels.get(client) is channel:
            del self.channels[client]
            self._dropped.add(client)  # a late poll must not open it again
        for request_id in list(channel.requests):
            self._abort(request_id)
        channel.requests.clear()


def _restart_ranks(ranks: list[Any]) -> None:
    """Restart a group's other ranks and wait until each is back, its model loaded (a rank left
    from the group before may be waiting in an all-reduce of the old one, or replaying its
    plans). Ray's kill is asynchronous: a rank is back when it answers as a new incarnation."""
    import ray

    before: list[int | None] = []
    for rank in ranks:
        try:
            before.append(ray.get(rank.info.remote(), timeout=30)["incarnation"])
        except ray.exceptions.RayError:  # dead or restarting already
            before.append(None)
        ray.kill(rank, no_restart=False)
    for rank, old in zip(ranks, before, strict=True):

        def restarted(info: dict[str, Any], old: int | None = old) -> bool:
            return bool(info["incarnation"] != old)

        info_when_up(rank, RESTART_TIMEOUT_S, restarted)
