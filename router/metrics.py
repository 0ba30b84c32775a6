"""The router's Prometheus metrics (served at GET /metrics), one registry per router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "outrider_requests", "Requests by API and outcome", ["api", "status"], registry=r
        )
        self.in_flight = Gauge(
            "outrider_requests_in_flight",
            "Admitted, unfinished requests on this replica",
            registry=r,
        )
        self.ttft = Histogram(
            "outrider_time_to_first_token_seconds",
            "Time from admission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "outrider_inter_token_latency_seconds",
            "Time between streamed steps, per token they carried",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "outrider_request_latency_seconds",
            "Time from admission to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("outrider_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "outrider_generation_tokens", "Generated tokens", registry=r
        )
        self.drafted = Counter(
            "outrider_spec_draft_tokens", "Draft tokens proposed for verification", registry=r
        )
        self.accepted = Counter(
            "outrider_spec_accepted_tokens", "Draft tokens the target accepted", registry=r
        )
        self.acceptance_length = Histogram(
            "outrider_spec_mean_acceptance_length",
            "Per request: tokens committed per verify step",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8),
            registry=r,
        )
        self.queue_depth = Gauge(
            "outrider_verifier_queue_depth", "Running + waiting requests", ["group"], registry=r
        )
        self.kv_usage = Gauge(
            "outrider_verifier_kv_usage", "Fraction of KV blocks held", ["group"], registry=r
        )
        self.routed = Counter(
            "outrider_routed", "Routing decisions by reason", ["group", "reason"], registry=r
        )
        self.hints_late = Counter(
            "outrider_prefix_hints_late",
            "Requests routed by load alone: Redis's prefix hints were not back in time",
            registry=r,
        )
        self.migrations = Counter(
            "outrider_migrations",
            "Requests moved on from a verifier group that failed under them",
            ["from_group", "to_group"],
            registry=r,
        )
        self.redis_up = Gauge(
            "outrider_redis_up", "Whether Redis answered this replica's last call", registry=r
        )
        self.redis_outages = Counter(
            "outrider_redis_outages", "Times Redis stopped answering this replica", registry=r
        )
        self.degraded_requests = Counter(
            "outrider_degraded_requests",
            "Requests served while Redis was down (no registry, prefix hints or key checks)",
            registry=r,
        )
        self.registry_held = Gauge(
            "outrider_registry_held_requests",
            "Requests whose registry writes wait for Redis to come back",
            registry=r,
        )
        self.registry_dropped = Counter(
            "outrider_registry_dropped_requests",
            "Requests whose held registry writes were dropped (too many held)",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
