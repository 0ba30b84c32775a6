"""The bodies of the pools' Ray actors other than the verifier's engine: drafters, prefill
workers and the ranks > 0 of a tensor-parallel verifier group, with the helpers every actor uses
(its engine config from the deployment config, its CPU threads, its device, where it runs).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cluster import logs, telemetry
from cluster.config import DeploymentConfig, from_dict
from cluster.drafter_worker import DrafterWorker, DraftReply, DraftStep, Handshake
from cluster.engine_metrics import ActorMetrics
from cluster.links import LinkAddress, LinkError, TensorLink
from cluster.output_reader import actor_gone
from cluster.prefill import PrefillWorker
from cluster.step_channel import (
    ChannelAddress,
    ChannelError,
    ChannelTimeout,
    Failure,
    StepClient,
    StepServer,
)
from workers.engine.heap import freeze_startup_heap
from workers.engine.model_runner import ModelRunner, RunnerOutput, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.tensor_parallel import build_sharded_model, emulate_row_parallel
from workers.model.transformer import TransformerLM, make_deterministic

log = logging.getLogger(__name__)

RAY_NAMESPACE = "outrider"
DRAFT_DEADLINE_S = 1.0


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def assigned_device() -> str:
    """Where this actor's models live: the GPU Ray gave it ("cuda": Ray sets
    CUDA_VISIBLE_DEVICES to it), else the CPU. A pool asks for GPUs by its `gpus` resource."""
    import ray
    import torch

    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


def use_assigned_cpus() -> None:
    """Torch threads = the CPUs Ray gave this actor (at least one)."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))


def where() -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "gpu_ids": list(ray.get_gpu_ids())}


def info_when_up(
    actor: Any, timeout_s: float, changed: Callable[[dict[str, Any]], bool] = lambda _: True
) -> dict[str, Any]:
    """The actor's `info` once it answers (and `changed` holds of it), for an actor that may be
    restarting: Ray fails calls to it at once meanwhile, and its constructor may load a model."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info: dict[str, Any] = ray.get(actor.info.remote(), timeout=timeout_s)
            if changed(info):
                return info
        except actor_gone():
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"an actor did not answer as asked within {timeout_s:.0f} s")
        time.sleep(0.5)


def start_tracing(config: DeploymentConfig) -> None:
    t = config.telemetry
    telemetry.setup_tracing(t.exporter, t.otlp_endpoint, t.service_name)


class DrafterActor:
    """Ray actor body of a drafter (wrapped with `ray.remote` in `Runtime`)."""

    def __init__(self, config: dict[str, Any], name: str) -> None:
        import torch

        from workers.engine.factory import build_drafters, needs_target
        from workers.model.loader import build_model, load_config, parse_dtype

        torch.set_num_threads(1)
        deployment = from_dict(config)
        logs.configure(deployment.router.log_format)
        method = deployment.pools.drafter.method
        self.device = assigned_device()
        spec = deployment.model_spec(self.device)

        def make() -> Any:
            # A draft model from its own file needs only the target's config: a drafter beside
            # a large target never loads the target's weights.
            checkpoint = target = None
            if needs_target(spec, method):
                checkpoint = spec.load(deployment.model)
                target = build_model(checkpoint, dtype=parse_dtype(spec.dtype), device=self.device)
            target_config = checkpoint.config if checkpoint else load_config(deployment.model)
            settings = deployment.engine_config()
            drafters, seconds = build_drafters(
                spec, settings, target_config, checkpoint, target, progress=False, only=method
            )
            self.token_seconds = seconds.get(method, 0.0)
            return drafters[method]

        self.token_seconds = 0.0  # drafting one token here; the verifier weighs it
        pool = deployment.pools.drafter
        self.metrics = ActorMetrics("drafter", name)
        self.metrics.count_restart()
        self.worker = DrafterWorker(
            make, name, pool.draft_ahead, pool.keep_drafting_ahead, self._record_step
        )
        freeze_startup_heap()

    def _record_step(self, message: DraftStep, reply: DraftReply) -> None:
        m = self.metrics
        m.observe("outrider_drafter_step_seconds", reply.handled_s)
        m.observe("outrider_drafter_draft_seconds", reply.seconds)
        m.inc("outrider_drafter_proposed_tokens", sum(len(d[0]) for d in reply.drafts.values()))
        m.inc("outrider_drafter_ahead_served", reply.ahead_served)
        width = message.feature_rows * message.feature_width
        m.inc("outrider_drafter_feature_bytes_received", width * _itemsize(message.feature_dtype))
        m.set("outrider_drafter_sequences", self.worker.info()["sequences"])

    def info(self) -> dict[str, Any]:
        return {
            **self.worker.info(),
            "token_seconds": self.token_seconds,
            "device": self.device,
            **where(),
        }

    def open_link(self, address: LinkAddress) -> Handshake:
        """The feature link, and the step channel the verifier's messages come over."""
        return self.worker.open_link(address)


def compute_as_group(model: TransformerLM, world: int) -> None:
    """A prefill worker's model computes as its verifiers' tensor-parallel groups do, so that a
    prompt it prefills continues there as if the group had prefilled it (the same K/V bits on
    our CPU kernels; workers/model/tensor_parallel.py `emulate_row_parallel`). Groups of more
    than two ranks add their partials in an order no single process reproduces: their remote
    prefills may differ from local ones in the last bits, which the log says."""
    if world == 1:
        return
    try:
        emulate_row_parallel(model, world)
    except ValueError as exc:
        log.warning(
            "prefill worker: %s; a prompt it prefills may continue with other last bits than "
            "one the verifier group prefills itself",
            exc,
        )
        return
    log.info("prefill worker: computes as a tensor-parallel group of %d ranks", world)


class PrefillActor:
    """Ray actor body of a prefill worker."""

    def __init__(self, config: dict[str, Any], name: str) -> None:

        from workers.model.loader import build_model, parse_dtype

        use_assigned_cpus()
        deployment = from_dict(config)
        logs.configure(deployment.router.log_format)
        self.name = name
        self.device = assigned_device()
        spec = deployment.model_spec(self.device)
        model = build_model(
            spec.load(deployment.model), dtype=parse_dtype(spec.dtype), device=self.device
        )
        compute_as_group(model, deployment.pools.verifier.tensor_parallel_size)
        if deployment.engine.deterministic:  # as its verifiers compute (a GPU's kernels)
            make_deterministic(model, deployment.speculative.tree_nodes)
        self.worker = PrefillWorker(
            model, deployment.engine.max_model_len, deployment.engine.block_size
        )
        self.metrics = ActorMetrics("prefill", name)
        self.metrics.count_restart()
        freeze_startup_heap()

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "device": self.device, **where()}

    def open_link(self, address: Any, verifier: str) -> None:
        self.worker.open_link(address, verifier)

    def prefill(
        self, token_ids: list[int], hidden_layers: list[int], verifier: str
    ) -> dict[str, Any]:
        timing = self.worker.prefill(token_ids, hidden_layers, verifier)
        m = self.metrics
        m.observe("outrider_prefill_seconds", timing["compute_s"])
        m.inc("outrider_prefill_tokens", len(token_ids) - timing["reused_tokens"])
        m.inc("outrider_prefill_reused_tokens", timing["reused_tokens"])
        m.inc("outrider_kv_transfer_bytes", timing["bytes"])
        m.observe("outrider_kv_transfer_seconds", timing["transfer_s"])
        return timing


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the other ranks of a verifier group replay each step (plain data). `kv_writes`:
    the cache slots of each remote prefill that landed on rank 0 since the last step; each rank
    receives its heads' slice of those K/V from rank 0 over the group, in this order, before
    the block copies and the forward (rank 0 wrote them at `add_request`, before scheduling the
    step that made the copies)."""

    block_copies: list[tuple[int, int]]
    seqs: list[SeqForward]
    kv_writes: list[list[int]] = field(default_factory=list)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: before each forward, the batch plan goes to the other ranks over their
    step channels (cluster/step_channel.py; a Ray call each would start them 2-3 ms late on a
    busy node), not awaited; the forward's all-reduces keep the ranks in step. Their replies
    (None, or the `Failure` a rank raised) are read as they come."""

    feeds_tokens = False  # the other ranks replay plans of host tokens
    interruptible = False  # every rank runs every layer: their all-reduces pair up

    def __init__(
        self,
        runner: ModelRunner,
        ranks: list[StepClient],
        group: TensorLink | None = None,
        kv_heads: Sequence[range] = (),
    ) -> None:
        super().__init__(runner.model, runner.kv_cache)
        self.ranks = ranks
        self.group = group  # the group's link: remote-prefill slices go to the ranks over it
        self.kv_heads = list(kv_heads)  # each rank's KV heads of the whole model's
        self._copies: list[tuple[int, int]] = []
        self._writes: list[tuple[list[int], list[torch.Tensor]]] = []  # slots, a slice per rank
        self._pending: deque[tuple[StepClient, int]] = deque()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._copies += copies
        super().copy_blocks(copies)

    def write_prefilled(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """`kv` holds every KV head of the whole model: this rank's go into its cache now, the
        others' to their ranks with the next plan."""
        if len(self.kv_heads) != 1 + len(self.ranks) or self.group is None:
            raise ValueError("a tensor-parallel runner writes remote prefills with its group")
        if kv.shape[3] != self.kv_heads[-1].stop:
            raise ValueError(f"K/V of {kv.shape[3]} heads; the group splits {self.kv_heads}")
        mine, *theirs = (kv[:, :, :, h.start : h.stop] for h in self.kv_heads)
        super().write_prefilled(slots, mine.contiguous())
        self._writes.append((slots.tolist(), [t.contiguous() for t in theirs]))

    def forward(
        self,
        seqs: Sequence[SeqForward],
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
        interrupt: Callable[[], bool] | None = None,
        input_tokens: torch.Tensor | None = None,
    ) -> RunnerOutput:
        if interrupt is not None:  # every rank must run every layer (their all-reduces pair up)
            raise ValueError("a tensor-parallel forward cannot be interrupted")
        if input_tokens is not None:
            raise ValueError("a tensor-parallel group's ranks need their tokens on the host")
        # The other ranks need no logits: only rank 0 samples.
        writes, self._writes = self._writes, []
        plan = StepPlan(
            self._copies, [replace(s, num_logits=0) for s in seqs], [w[0] for w in writes]
        )
        self._copies = []
        self._reap()
        try:
            self._pending.extend((rank, rank.request(plan)) for rank in self.ranks)
            for _, slices in writes:
                for peer, part in enumerate(slices, start=1):
                    assert self.group is not None  # write_prefilled checked it
                    self.group.send(part, wait=False, peer=peer)
        except (ChannelError, LinkError) as err:
            raise RankFailed(f"a tensor-parallel rank is gone: {err}") from err
        try:
            out = super().forward(seqs, hidden_layers, return_final_hidden)
            if writes and self.group is not None:
                self.group.flush()  # the ranks received them before their first all-reduce
        except Exception as err:  # a rank vanished mid-forward, or this rank failed: the
            # others are left waiting in an all-reduce that will not pair up
            raise RankFailed(f"the group's forward failed: {err!r}") from err
        return out

    def _reap(self) -> None:
        """Read the replies that have come; wait for the oldest where a rank fell far behind.
        A rank's failure is raised here."""
        while self._pending:
            rank, seq = self._pending[0]
            behind = len(self._pending) > 64 * len(self.ranks)
            try:
                reply = rank.reply(seq, time.monotonic() + (60.0 if behind else 0.0))
            except ChannelTimeout:
                if behind:
                    raise RankFailed("a tensor-parallel rank is 64 steps behind") from None
                return
            except ChannelError as err:
                raise RankFailed(f"a tensor-parallel rank is gone: {err}") from err
            self._pending.popleft()
            if isinstance(reply, Failure):
                raise RankFailed(f"a tensor-parallel rank failed: {reply.kind}: {reply.message}")


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel group failed or vanished, or a forward failed part-way: the
    ranks are out of step and the group cannot go on (rank 0 restarts it: cluster/verifier.py)."""


class VerifierRankActor:
    """Ray actor body of rank r > 0 of a tensor-parallel verifier group: its slice of the
    target and of the KV cache; it replays rank 0's batch plans."""

    def __init__(self, config: dict[str, Any], name: str, rank: int, world: int) -> None:

        from workers.model.loader import parse_dtype

        use_assigned_cpus()
        deployment = from_dict(config)
        logs.configure(deployment.router.log_format)
        self.name, self.rank, self.world = name, rank, world
        device = assigned_device()
        spec = deployment.model_spec(device)
        checkpoint = spec.load(deployment.model)
        model = build_sharded_model(checkpoint, rank, world, None, parse_dtype(spec.dtype), device)
        if deployment.engine.deterministic:  # as rank 0's engine does
            make_deterministic(model, deployment.speculative.tree_nodes)
        blocks = deployment.engine_config().kv_blocks
        block_size = deployment.engine.block_size
        cache = PagedKVCache(model.config, blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        freeze_startup_heap()
        self.link: TensorLink | None = None
        self.plans: StepServer | None = None  # rank 0's plans arrive here
        self.incarnation = time.time_ns()  # a restarted rank gets a new one

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "incarnation": self.incarnation, **where()}

    def join_group(self, address: Any) -> ChannelAddress:
        """Join the group's link; returns where rank 0 sends its plans."""
        self.link = TensorLink.join(address, timeout_s=60.0, rank=self.rank)
        self.runner.model.reduce = self.link.all_reduce
        if self.plans is None:
            self.plans = StepServer(self.step, f"{self.name}-plans")
        return self.plans.address()

    def step(self, plan: StepPlan) -> None:
        assert self.link is not None  # plans come only once the group is joined
        replay(self.runner, self.link, plan)


def replay(runner: ModelRunner, group: TensorLink, plan: StepPlan) -> None:
    """Rank r > 0's side of a step: the remote prefills' K/V slices from rank 0 into their
    slots, the block copies, the forward."""
    cache = runner.kv_cache
    layers, _, _, _, heads, dim = cache.data.shape
    for slots in plan.kv_writes:
        kv = torch.empty((layers, 2, len(slots), heads, dim), dtype=cache.data.dtype)
        group.recv_into(kv, peer=0)
        cache.write_slots(torch.tensor(slots, device=cache.data.device), kv)
    runner.copy_blocks(plan.block_copies)
    runner.forward(plan.seqs)
