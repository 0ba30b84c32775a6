"""OpenTelemetry traces of every request and every draft/verify round.

The caller of `Runtime.submit` opens the request's span and passes its context to the verifier
as a W3C `traceparent` carrier inside the Ray call; the verifier continues the trace there with
one child span per engine step the request took part in: `outrider.prefill` (a prompt chunk) or
`outrider.verify_round` (drafting and verification), with the drafter method, k, the accepted
count, the step's draft and verify time and the bytes of hidden states moved to the drafter.

Exporters by config (`telemetry` in cluster/config.py): OTLP over HTTP when `otlp_endpoint` is
set, or `exporter: console | memory | none`. `memory` keeps finished spans in the process for
tests (`finished_spans`).

No span is lost when a process ends: OTLP spans leave in batches at most `EXPORT_DELAY_MS`
after they end, and whoever stops a process that exports them flushes it first
(`flush_tracing`: the driver in `Runtime.shutdown`, each verifier through
`VerifierActor.flush_telemetry` before its pool is stopped). A process killed outright (its
node lost) loses at most its last `EXPORT_DELAY_MS` of spans.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers.engine.outputs import StepReport

TRACER_NAME = "outrider"
EXPORT_DELAY_MS = 200  # the longest a finished span waits in its batch before it is sent

_memory: InMemorySpanExporter | None = None


def setup_tracing(exporter: str, otlp_endpoint: str | None, service_name: str) -> None:
    """Install this process's tracer provider (once; later calls keep the first)."""
    global _memory
    if not otlp_endpoint and exporter == "none":
        return  # the API's no-op tracer: spans cost nothing
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        exporter_ = OTLPSpanExporter(endpoint=endpoint)
        provider.add_span_processor(
            BatchSpanProcessor(exporter_, schedule_delay_millis=EXPORT_DELAY_MS)
        )
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "memory":
        _memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_memory))
    trace.set_tracer_provider(provider)


def flush_tracing(timeout_s: float = 10.0) -> bool:
    """Send every span this process has finished (before it ends); whether all went."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        return provider.force_flush(int(timeout_s * 1000))
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(span: trace.Span) -> dict[str, str]:
    """A carrier (W3C traceparent) naming `span` as the parent, to pass in a Ray call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None) -> context.Context:
    return propagate.extract(carrier or {})


def finished_spans() -> list[dict[str, Any]]:
    """Spans finished in this process (exporter `memory` only), as plain data."""
    if _memory is None:
        return []
    return [
        {
            "name": s.name,
            "trace_id": f"{s.context.trace_id:032x}",
            "span_id": f"{s.context.span_id:016x}",
            "parent_id": None if s.parent is None else f"{s.parent.span_id:016x}",
            "attributes": dict(s.attributes or {}),
        }
        for s in _memory.get_finished_spans()
    ]


class RoundTracer:
    """Turns the engine's step reports into child spans of each traced request's span."""

    def __init__(self) -> None:
        self._parents: dict[str, context.Context] = {}
        # Looked up once, not a round (a proxy until a provider is set, then the provider's)
        self._tracer = tracer()

    def start(self, request_id: str, carrier: dict[str, str] | None) -> None:
        self._parents[request_id] = extract(carrier)

    def finish(self, request_id: str) -> None:
        self._parents.pop(request_id, None)

    def __call__(self, report: StepReport) -> None:
        end_ns = report.start_ns + int((report.draft_s + report.forward_s) * 1e9)
        for r in report.rounds:
            parent = self._parents.get(r.request_id)
            if parent is None:
                continue
            name = "outrider.prefill" if r.prefill_tokens else "outrider.verify_round"
            span = self._tracer.start_span(name, context=parent, start_time=report.start_ns)
            span.set_attributes(
                {
                    "outrider.request_id": r.request_id,
                    "outrider.spec.method": r.method,
                    "outrider.spec.k": r.drafted,
                    "outrider.spec.accepted": r.accepted,
                    "outrider.prefill_tokens": r.prefill_tokens,
                    "outrider.draft_s": round(report.draft_s, 6),
                    "outrider.verify_s": round(report.forward_s, 6),
                    "outrider.bytes_moved": r.feature_bytes,
                    "outrider.batch_size": len(report.rounds),
                }
            )
            span.end(end_time=end_ns)
