"""No span is lost when a process ends (cluster/telemetry.py), against a real OTLP/HTTP receiver:
a process that flushes before it ends sends every span, and one killed outright (no exit
handlers, as a lost node) has sent those that ended more than `EXPORT_DELAY_MS` before."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cluster.telemetry import EXPORT_DELAY_MS
from tests.cluster.otlp import OtlpReceiver
from tests.unit.helpers import ROOT

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

SPANS = """
import os, sys, time
from cluster import telemetry
telemetry.setup_tracing("none", sys.argv[1], "outrider-test")
tracer = telemetry.tracer()
for _ in range(7):
    tracer.start_span("outrider.verify_round").end()
if sys.argv[2] == "flush":
    assert telemetry.flush_tracing()
else:
    time.sleep(float(sys.argv[2]))
os._exit(0)  # no exit handlers: what was not sent by now is lost
"""


def run_spans(url: str, then: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SPANS, url, then], cwd=ROOT, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


@pytest.mark.parametrize("then", ["flush", str(3 * EXPORT_DELAY_MS / 1000)])
def test_spans_reach_the_receiver_before_the_process_ends(then: str) -> None:
    receiver = OtlpReceiver()
    try:
        run_spans(receiver.url, then)
        deadline = time.monotonic() + 5
        while len(receiver.names) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        receiver.close()
    assert receiver.names == ["outrider.verify_round"] * 7
