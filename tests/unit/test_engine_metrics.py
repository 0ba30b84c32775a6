"""The engine metrics a verifier exports (cluster/engine_metrics.py), recorded from a real engine
(a tiny model, ngram drafts, KV pressure, a repeated prompt) into a recorder that keeps what it
is given: they agree with the engine's own counters. Their export through Ray to Prometheus is
tested on a real cluster in tests/cluster/test_runtime.py."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from cluster.engine_metrics import (
    ALL,
    COUNTER,
    GAUGE,
    POOLS,
    ActorMetrics,
    MetricSpec,
    VerifierMetrics,
)
from tests.factories import tiny_model
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RoundReport, StepReport
from workers.engine.sampling_params import SamplingParams


class Kept:
    """Every value recorded, by metric and tags."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)
        self.defaults: dict[str, str] = {}

    def recorder(self, spec: MetricSpec, defaults: dict[str, str]) -> Any:
        self.defaults = defaults
        kept = self

        class One:
            def record(self, value: float, tags: dict[str, str]) -> None:
                kept.values[(spec.name, tuple(sorted(tags.items())))].append(value)

        return One()

    def total(self, name: str, **tags: str) -> float:
        return sum(
            sum(v) for (n, t), v in self.values.items() if n == name and tags.items() <= set(t)
        )

    def last(self, name: str) -> float:
        (values,) = [v for (n, _), v in self.values.items() if n == name]
        return values[-1]

    def count(self, name: str) -> int:
        return sum(len(v) for (n, _), v in self.values.items() if n == name)


@pytest.fixture(scope="module")
def recorded() -> tuple[Kept, LLMEngine]:
    model = tiny_model(seed=4, max_position_embeddings=512)
    config = EngineConfig(
        max_model_len=512,
        num_kv_blocks=12,  # fewer than four sequences want: preemption
        block_size=8,
        spec=SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
    )
    engine = LLMEngine(model, config, drafters={"ngram": NgramDrafter(NgramConfig(1, 3))})
    kept = Kept()
    prefills = {"remote": 0, "local": 3, "failures": 1, "passed_over": 2}  # as a verifier counts
    metrics = VerifierMetrics(
        ActorMetrics("verifier", "verifier-g0-r0", kept.recorder), engine, prefills=prefills
    )
    engine.step_listeners.append(metrics)
    # Flushed after every step (the actor's thread does once a second): its gauges see every
    # step's KV and queue.
    engine.step_listeners.append(lambda report: metrics.flush())
    repeating = [5, 6, 7, 8, 9] * 6
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.generate([repeating, [3, 4] * 10, list(range(10, 40)), [11, 12, 13] * 7], params)
    engine.generate([repeating], params)
    engine.generate([repeating], params)  # its prompt is in the prefix cache now
    metrics.flush()
    return kept, engine


def test_speculation_counters_agree_with_the_engine(recorded: tuple[Kept, LLMEngine]) -> None:
    kept, engine = recorded
    stats = engine.stats
    assert kept.defaults == {"pool": "verifier", "actor": "verifier-g0-r0"}
    accepted = kept.total("outrider_spec_decode_num_accepted_tokens", method="ngram")
    assert accepted == stats.accepted > 0
    drafted = kept.total("outrider_spec_decode_num_draft_tokens", method="ngram")
    assert drafted == stats.drafted
    per_position = [
        kept.total("outrider_spec_decode_num_accepted_tokens_per_pos", position=str(i))
        for i in range(3)
    ]
    engine_counts = [*stats.accepted_per_position, 0, 0, 0][:3]
    assert per_position == engine_counts and sum(per_position) == accepted
    drafts = kept.total("outrider_spec_decode_num_drafts")
    lengths = kept.values[("outrider_spec_decode_acceptance_length", (("method", "ngram"),))]
    assert len(lengths) == drafts > 0
    assert sum(lengths) == accepted + drafts  # each round: its accepted drafts + 1
    assert kept.last("outrider_spec_decode_k") <= 3


def test_steps_kv_queue_and_cache_counters(recorded: tuple[Kept, LLMEngine]) -> None:
    kept, engine = recorded
    steps = kept.count("outrider_engine_step_seconds")
    assert steps == kept.count("outrider_engine_batch_size") > 0
    assert kept.count("outrider_engine_forward_seconds") == steps
    assert max(kept.values[("outrider_engine_batch_size", ())]) >= 2  # batched
    assert kept.total("outrider_num_preemptions") == engine.scheduler.num_preemptions > 0
    hits = kept.total("outrider_prefix_cache_hits")
    assert hits == engine.scheduler.prefix_hit_tokens >= 24  # three blocks of the repeat
    assert kept.total("outrider_prefix_cache_queries") >= hits
    assert kept.total("outrider_prompt_tokens_computed") > 0
    # Sampled after the work: no request holds a block, none runs or waits.
    assert kept.last("outrider_kv_cache_blocks_used") == 0
    assert kept.last("outrider_kv_cache_blocks_free") == 12
    assert kept.last("outrider_num_requests_running") == 0
    assert kept.last("outrider_num_requests_waiting") == 0
    # The verifier's prefill counts, exported as they grew, by outcome (none remote: no series).
    assert kept.total("outrider_remote_prefill_requests", outcome="local") == 3
    assert kept.total("outrider_remote_prefill_requests", outcome="failed") == 1
    assert kept.total("outrider_remote_prefill_requests", outcome="passed_over") == 2
    assert not kept.total("outrider_remote_prefill_requests", outcome="remote")
    used = kept.values[("outrider_kv_cache_blocks_used", ())]
    assert max(used) == 12  # under pressure, every block was held at some step


def test_steps_are_gathered_on_the_engine_thread_and_recorded_at_a_flush(
    recorded: tuple[Kept, LLMEngine],
) -> None:
    """A step only gathers; a flush records each histogram value, each counter's growth once,
    and the last k."""
    _, engine = recorded
    kept = Kept()
    metrics = VerifierMetrics(ActorMetrics("verifier", "v", kept.recorder), engine)
    for accepted in (2, 0):
        drafted = RoundReport("a", "ngram", 0, 3, accepted, 0)
        rounds = [drafted, RoundReport("b", "none", 0, 0, 0, 0)]
        metrics(StepReport(0, 0.001, 0.004, rounds))
    assert not kept.values
    metrics.flush()
    assert kept.count("outrider_engine_step_seconds") == 2
    assert kept.values[("outrider_spec_decode_acceptance_length", (("method", "ngram"),))] == [3, 1]
    grown = kept.values[("outrider_spec_decode_num_draft_tokens", (("method", "ngram"),))]
    assert grown == [6]  # both steps' drafts, in one increment
    assert kept.total("outrider_spec_decode_num_accepted_tokens_per_pos") == 2
    assert kept.last("outrider_spec_decode_k") == 3
    metrics.flush()  # nothing new: the histograms and counters stay as they were
    assert kept.count("outrider_engine_step_seconds") == 2 and len(grown) == 1


def test_a_metric_is_recorded_only_as_declared() -> None:
    kept = Kept()
    metrics = ActorMetrics("prefill", "prefill-0", kept.recorder)
    with pytest.raises(KeyError):
        metrics.inc("outrider_spec_decode_num_drafts", method="ngram")  # a verifier's metric
    with pytest.raises(TypeError, match="histogram"):
        metrics.inc("outrider_prefill_seconds")
    with pytest.raises(ValueError, match="tags"):
        metrics.inc("outrider_prefill_tokens", 5, method="x")
    metrics.inc("outrider_prefill_tokens", 0)  # nothing grew: no series
    assert not kept.values


def test_every_metric_is_declared_once_with_its_series() -> None:
    names = [spec.name for spec in ALL]
    assert len(names) == len(set(names))
    assert all(n.startswith("outrider_") and ":" not in n for n in names)
    assert {p for p in POOLS} == {"verifier", "drafter", "prefill"}
    for spec in ALL:
        if spec.kind == COUNTER:
            assert spec.series() == (f"ray_{spec.name}_total",)
        elif spec.kind == GAUGE:
            assert spec.series() == (f"ray_{spec.name}",) and not spec.buckets
        else:
            assert list(spec.buckets) == sorted(spec.buckets) and spec.buckets
