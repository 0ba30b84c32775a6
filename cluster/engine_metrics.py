"""Engine metrics: what the verifier (rank 0), drafter and prefill actors export through Ray's
metrics API. Ray's Prometheus endpoint (each node's metrics export port) serves them, and the Ray
dashboard's Metrics view and Grafana read them there; every series carries its actor's `pool`
and `actor` labels.

Names follow vLLM's (`vllm:spec_decode_num_accepted_tokens_per_pos` is
`outrider_spec_decode_num_accepted_tokens_per_pos` here) with an underscore, not a colon: Ray's
OpenTelemetry exporter drops names with a colon. Ray puts `ray_` in front when it exports, and
Prometheus adds `_total` to counters and `_bucket`/`_sum`/`_count` to histograms
(`MetricSpec.series`). The router's own metrics are in router/metrics.py.

Counters and histograms, not gauges of averages: a mean acceptance length is
`rate(..._acceptance_length_sum) / rate(..._acceptance_length_count)` over any window. Gauges
hold what is true now (KV blocks, queues, the current k).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
ACTOR_TAGS = ("pool", "actor")
RAY_PREFIX = "ray_"

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    help: str
    tags: tuple[str, ...] = ()  # besides ACTOR_TAGS
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds

    def series(self) -> tuple[str, ...]:
        """The names Prometheus scrapes for it from Ray's endpoint."""
        base = RAY_PREFIX + self.name
        if self.kind == COUNTER:
            return (base + "_total",)
        if self.kind == HISTOGRAM:
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


VERIFIER = (
    MetricSpec(
        "outrider_engine_step_seconds",
        HISTOGRAM,
        "An engine step: drafting, the target's forward and verification",
        buckets=_SECONDS,
    ),
    MetricSpec(
        "outrider_engine_forward_seconds",
        HISTOGRAM,
        "The target's forward and verification within a step",
        buckets=_SECONDS,
    ),
    MetricSpec(
        "outrider_engine_draft_seconds",
        HISTOGRAM,
        "Waiting for drafts within a step (remote drafters: the hand-off included)",
        buckets=_SECONDS,
    ),
    MetricSpec("outrider_engine_batch_size", HISTOGRAM, "Sequences in a step", buckets=_COUNTS),
    MetricSpec(
        "outrider_engine_step_tokens",
        HISTOGRAM,
        "Tokens a step's forward computed: prompt chunks, and 1 + its draft per verified sequence",
        buckets=_COUNTS,
    ),
    MetricSpec(
        "outrider_prompt_tokens_computed",
        COUNTER,
        "Prompt tokens this verifier computed (not from its prefix cache or a prefill worker)",
    ),
    MetricSpec(
        "outrider_spec_decode_num_drafts",
        COUNTER,
        "Verify rounds of a sequence that checked a draft",
        ("method",),
    ),
    MetricSpec(
        "outrider_spec_decode_num_draft_tokens", COUNTER, "Draft tokens verified", ("method",)
    ),
    MetricSpec(
        "outrider_spec_decode_num_accepted_tokens", COUNTER, "Draft tokens accepted", ("method",)
    ),
    MetricSpec(
        "outrider_spec_decode_num_accepted_tokens_per_pos",
        COUNTER,
        "Draft tokens accepted at each position of their draft (0: the first)",
        ("method", "position"),
    ),
    MetricSpec(
        "outrider_spec_decode_acceptance_length",
        HISTOGRAM,
        "Tokens a verify round with a draft committed: its accepted drafts + 1",
        ("method",),
        _LENGTHS,
    ),
    MetricSpec(
        "outrider_spec_decode_k",
        GAUGE,
        "Draft tokens the latest step asked of a method (the most of any of its sequences)",
        ("method",),
    ),
    MetricSpec(
        "outrider_spec_decode_late_drafts",
        COUNTER,
        "Remote drafters' proposals that missed the step's deadline (verified without drafts)",
    ),
    MetricSpec(
        "outrider_spec_decode_failed_drafts",
        COUNTER,
        "Drafter calls that failed (a dead, restarting or raising drafter)",
        ("method",),
    ),
    MetricSpec(
        "outrider_drafter_feature_bytes",
        COUNTER,
        "Hidden-state bytes handed to drafters that read the target's features",
    ),
    MetricSpec("outrider_kv_cache_blocks_used", GAUGE, "KV blocks held by requests"),
    MetricSpec(
        "outrider_kv_cache_blocks_free", GAUGE, "KV blocks free (cached prefixes among them)"
    ),
    MetricSpec(
        "outrider_prefix_cache_queries",
        COUNTER,
        "Prompt tokens looked up in the prefix cache when their request was admitted",
    ),
    MetricSpec("outrider_prefix_cache_hits", COUNTER, "Prompt tokens found in the prefix cache"),
    MetricSpec("outrider_num_requests_running", GAUGE, "Requests in the running batch"),
    MetricSpec("outrider_num_requests_waiting", GAUGE, "Requests waiting to be admitted"),
    MetricSpec(
        "outrider_num_preemptions",
        COUNTER,
        "Sequences preempted for KV blocks (recomputed when readmitted)",
    ),
    MetricSpec(
        "outrider_steps_given_up",
        COUNTER,
        "Steps given up between layers for an arriving request of another tenant, whose "
        "prefill then ran first (workers/engine/step_interrupt.py)",
    ),
    MetricSpec(
        "outrider_remote_prefill_requests",
        COUNTER,
        "Prompts by where they were prefilled: remote (a prefill worker), local, failed "
        "(a worker failed or was not back in time, so prefilled here) or passed_over (the "
        "worker was not back in time within the last pools.prefill.retry_after_s, so "
        "prefilled here)",
        ("outcome",),
    ),
)

PREFILL = (
    MetricSpec(
        "outrider_prefill_seconds",
        HISTOGRAM,
        "A prompt's forward on a prefill worker (its K/V sent layer by layer meanwhile)",
        buckets=_SECONDS,
    ),
    MetricSpec("outrider_prefill_tokens", COUNTER, "Prompt tokens a prefill worker computed"),
    MetricSpec(
        "outrider_prefill_reused_tokens",
        COUNTER,
        "Prompt tokens a prefill worker took from its previous prompt",
    ),
    MetricSpec(
        "outrider_kv_transfer_bytes",
        COUNTER,
        "K/V, hidden states and logits a prefill worker sent to verifiers",
    ),
    MetricSpec(
        "outrider_kv_transfer_seconds",
        HISTOGRAM,
        "From the end of a prefill's forward until its last tensor had arrived",
        buckets=_SECONDS,
    ),
)

DRAFTER = (
    MetricSpec(
        "outrider_drafter_step_seconds",
        HISTOGRAM,
        "A verifier's step inside a drafter actor: its events, features and drafting",
        buckets=_SECONDS,
    ),
    MetricSpec(
        "outrider_drafter_draft_seconds",
        HISTOGRAM,
        "Drafting inside a drafter actor's step",
        buckets=_SECONDS,
    ),
    MetricSpec("outrider_drafter_proposed_tokens", COUNTER, "Draft tokens a drafter proposed"),
    MetricSpec(
        "outrider_drafter_ahead_served",
        COUNTER,
        "Proposals answered from what the drafter had drafted ahead",
    ),
    MetricSpec(
        "outrider_drafter_feature_bytes_received",
        COUNTER,
        "Hidden-state bytes a drafter received from its verifier",
    ),
    MetricSpec("outrider_drafter_sequences", GAUGE, "Sequences a drafter holds"),
)

COMMON = (
    MetricSpec(
        "outrider_actor_restarts",
        COUNTER,
        "Restarts of the actor, counted by the restarted process (Ray restarts a dead actor)",
    ),
)

# The verifier's prefill counts (cluster/prefill_client.py `PrefillClient.stats`) by their
# metric's outcome.
PREFILL_OUTCOMES = {
    "remote": "remote",
    "local": "local",
    "failures": "failed",
    "passed_over": "passed_over",
}

POOLS = {"verifier": VERIFIER + COMMON, "prefill": PREFILL + COMMON, "drafter": DRAFTER + COMMON}
ALL = VERIFIER + PREFILL + DRAFTER + COMMON


class Recorder(Protocol):
    """What a metric does with a value (a Ray metric: Counter.inc, Gauge.set, Histogram.observe)."""

    def record(self, value: float, tags: dict[str, str]) -> None: ...


def ray_recorder(spec: MetricSpec, defaults: dict[str, str]) -> Recorder:
    """The Ray metric behind a spec, its actor's tags set as defaults."""
    from ray.util import metrics

    keys = ACTOR_TAGS + spec.tags
    metric: Any
    if spec.kind == COUNTER:
        metric = metrics.Counter(spec.name, spec.help, keys)
        record = metric.inc
    elif spec.kind == GAUGE:
        metric = metrics.Gauge(spec.name, spec.help, keys)
        record = metric.set
    else:
        metric = metrics.Histogram(spec.name, spec.help, list(spec.buckets), keys)
        record = metric.observe
    metric.set_default_tags(defaults)
    return _Bound(record)


@dataclass(frozen=True, slots=True)
class _Bound:
    call: Callable[..., None]

    def record(self, value: float, tags: dict[str, str]) -> None:
        self.call(value, tags=tags)


class ActorMetrics:
    """One actor's metrics. `recorder` makes the backend of each (Ray's by default; tests pass
    their own)."""

    def __init__(
        self,
        pool: str,
        actor: str,
        recorder: Callable[[MetricSpec, dict[str, str]], Recorder] = ray_recorder,
    ) -> None:
        self.specs = {spec.name: spec for spec in POOLS[pool]}
        defaults = {"pool": pool, "actor": actor}
        self._recorders = {name: recorder(spec, defaults) for name, spec in self.specs.items()}

    def _record(self, name: str, kind: str, value: float, tags: dict[str, str]) -> None:
        spec = self.specs[name]
        if spec.kind != kind:
            raise TypeError(f"{name} is a {spec.kind}")
        if set(tags) != set(spec.tags):
            raise ValueError(f"{name} takes the tags {spec.tags}, got {sorted(tags)}")
        self._recorders[name].record(value, tags)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value > 0:  # Ray refuses a zero increment; a counter that never grew has no series
            self._record(name, COUNTER, value, tags)

    def set(self, name: str, value: float, **tags: str) -> None:
        self._record(name, GAUGE, value, tags)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._record(name, HISTOGRAM, value, tags)

    def count_restart(self) -> None:
        """Count this process as a restart when Ray reconstructed the actor."""
        import ray

        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.inc("outrider_actor_restarts")


class Delta:
    """The growth of a cumulative number since it was last read (for counters kept elsewhere)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, key: str, total: float) -> float:
        grown = total - self._last.get(key, 0.0)
        self._last[key] = total
        return max(grown, 0.0)


class VerifierMetrics:
    """A verifier's engine metrics. As a step listener of its engine it only gathers, on the
    engine's thread, what each step adds (the histograms' values, the counters' growth, the
    current k); `flush` records what was gathered, counters once for all their growth, and sets
    the gauges from the engine. A thread flushes every `interval_s` (`start_sampling`), so the
    Ray metric calls (about ten a step, 2% of a one-stream decode step on the 2-core VM) stay
    off the step, and an idle engine's KV and queue gauges read true."""

    def __init__(
        self,
        metrics: ActorMetrics,
        engine: Any,
        remote_drafters: Any = None,
        prefills: Mapping[str, float] | None = None,
    ) -> None:
        self.metrics = metrics
        self.engine = engine
        self.remote_drafters = remote_drafters  # a ShardedDrafter, when drafting is remote
        # The verifier's prefill counts by where each prompt went (remote, local, failures).
        self.prefills = prefills
        self._delta = Delta()
        self._lock = threading.Lock()  # the gathered values, between the engine and a flush
        self._observed: list[tuple[str, float, dict[str, str]]] = []
        self._grown: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self._k: dict[str, int] = {}  # the last step's k, by method
        self._flushing = threading.Lock()  # one flush at a time

    def __call__(self, report: Any) -> None:  # a StepReport
        observed: list[tuple[str, float, dict[str, str]]] = [
            ("outrider_engine_step_seconds", report.draft_s + report.forward_s, {}),
            ("outrider_engine_forward_seconds", report.forward_s, {}),
            ("outrider_engine_batch_size", len(report.rounds), {}),
        ]
        if report.verified:
            observed.append(("outrider_engine_draft_seconds", report.draft_s, {}))
        tokens = prompt = features = 0
        ks: dict[str, int] = {}
        grown: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        for r in report.rounds:
            features += r.feature_bytes
            if r.prefill_tokens:
                tokens += r.prefill_tokens
                prompt += r.prefill_tokens
                continue
            tokens += 1 + r.drafted
            if r.method != "none":
                ks[r.method] = max(ks.get(r.method, 0), r.drafted)
            if not r.drafted:
                continue
            method = (("method", r.method),)
            grown["outrider_spec_decode_num_drafts", method] += 1
            grown["outrider_spec_decode_num_draft_tokens", method] += r.drafted
            grown["outrider_spec_decode_num_accepted_tokens", method] += r.accepted
            observed.append(
                ("outrider_spec_decode_acceptance_length", r.accepted + 1, {"method": r.method})
            )
            for position in range(r.accepted):
                at = (("method", r.method), ("position", str(position)))
                grown["outrider_spec_decode_num_accepted_tokens_per_pos", at] += 1
        observed.append(("outrider_engine_step_tokens", tokens, {}))
        grown["outrider_prompt_tokens_computed", ()] += prompt
        grown["outrider_drafter_feature_bytes", ()] += features
        with self._lock:
            self._observed.extend(observed)
            self._grown.update(grown)
            self._k.update(ks)

    def flush(self) -> None:
        """Record what the steps since the last flush gathered, and the gauges now."""
        with self._flushing:
            with self._lock:
                observed, self._observed = self._observed, []
                grown, self._grown = self._grown, Counter()
                ks, self._k = self._k, {}
            m = self.metrics
            for name, value, tags in observed:
                m.observe(name, value, **tags)
            for (name, pairs), count in grown.items():
                m.inc(name, count, **dict(pairs))
            for method, k in ks.items():
                m.set("outrider_spec_decode_k", k, method=method)
            self._counted_elsewhere()
            self.sample()

    def _counted_elsewhere(self) -> None:
        """Counters the scheduler, the speculator, the remote drafters and the verifier's
        prefills keep."""
        m, grown = self.metrics, self._delta
        scheduler = self.engine.scheduler
        m.inc("outrider_num_preemptions", grown("preempted", scheduler.num_preemptions))
        m.inc("outrider_steps_given_up", grown("given_up", scheduler.num_steps_given_up))
        m.inc(
            "outrider_prefix_cache_queries",
            grown("queried", scheduler.prefix_queried_tokens),
        )
        m.inc("outrider_prefix_cache_hits", grown("hits", scheduler.prefix_hit_tokens))
        for method, failures in dict(self.engine.speculator.failures).items():
            m.inc(
                "outrider_spec_decode_failed_drafts",
                grown(f"failed/{method}", failures),
                method=method,
            )
        if self.remote_drafters is not None:
            late = grown("late", self.remote_drafters.stats.late)
            m.inc("outrider_spec_decode_late_drafts", late)
        if self.prefills is not None:
            for key, outcome in PREFILL_OUTCOMES.items():
                count = grown(f"prefill/{key}", self.prefills[key])
                m.inc("outrider_remote_prefill_requests", count, outcome=outcome)

    def sample(self) -> None:
        """Set the gauges from the engine now (read without the engine's lock: a hint, as the
        router's load reads are)."""
        engine, m = self.engine, self.metrics
        allocator = engine.allocator
        free = allocator.num_free_blocks
        m.set("outrider_kv_cache_blocks_used", allocator.num_blocks - free)
        m.set("outrider_kv_cache_blocks_free", free)
        m.set("outrider_num_requests_running", len(engine.scheduler.running))
        m.set("outrider_num_requests_waiting", len(engine.scheduler.waiting))

    def start_sampling(self, interval_s: float = 1.0) -> None:
        """Flush every `interval_s` from a thread of its own."""

        def run() -> None:
            while True:
                time.sleep(interval_s)
                try:
                    self.flush()
                except Exception:  # a metric must never take the verifier down
                    log.exception("recording the engine's metrics failed")

        threading.Thread(target=run, name="engine-metrics", daemon=True).start()
