"""A router replica shutting down (SIGTERM from Kubernetes, Ctrl-C): `Router.drain` refuses new
requests and fails `/ready` at once, lets the streams in flight finish within its grace period,
cuts the rest with an error that says how to resume them, and stops. Real routers over the
module's engine and Redis; a second replica (`open_router`, same Redis database) resumes a cut
request."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.backends import LocalBackend
from tests.router.helpers import (
    RunningRouter,
    Served,
    get,
    post,
    raw_completion_stream,
    small_workload,
    sse_events,
    start_router,
)

LONG = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}


def _streaming(router: RunningRouter, body: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    """A streaming completion on its own thread; its raw SSE body lands in the list."""
    raw: list[str] = []
    thread = threading.Thread(
        target=lambda: raw.append(post(f"{router.url}/v1/completions", {**body, "stream": True})[2])
    )
    thread.start()
    deadline = time.monotonic() + 30
    while router.service.in_flight == 0:  # admitted: the drain must wait for it
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    return thread, raw


def _stopped(router: RunningRouter, timeout_s: float = 30.0) -> bool:
    router.thread._thread.join(timeout_s)
    return not router.thread._thread.is_alive()


def test_a_drain_refuses_new_requests_and_lets_those_in_flight_finish(  # type: ignore[no-untyped-def]
    local_engine, checkpoint, redis_server, open_router
) -> None:
    body = {**LONG, "max_tokens": 48}
    _, whole, _, _ = post(f"{open_router.url}/v1/completions", body)
    router = start_router(LocalBackend(local_engine), checkpoint.tokenizer, redis_server, db=1)
    thread, raw = _streaming(router, body)
    router.thread.router.drain()
    code, err = get(f"{router.url}/ready")
    assert code == 503 and err["error"]["message"] == "this replica is shutting down"
    code, err, _, headers = post(f"{router.url}/v1/completions", {**body, "max_tokens": 2})
    assert code == 503 and err["error"]["type"] == "service_unavailable"
    assert "shutting down" in err["error"]["message"] and "retry-after" in headers
    thread.join(60)
    events = sse_events(raw[0])
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert _stopped(router)


def test_a_drain_cuts_what_outlives_its_grace_and_another_replica_resumes_it(  # type: ignore[no-untyped-def]
    local_engine, checkpoint, redis_server, open_router
) -> None:
    body = {**LONG, "max_tokens": 160}
    router = start_router(
        LocalBackend(local_engine), checkpoint.tokenizer, redis_server, db=1, shutdown_grace_s=0.3
    )
    received = b""
    with raw_completion_stream(router.port, body) as sock:
        while received.count(b"data: ") < 4:  # a few tokens in: some are committed
            received += sock.recv(65536)
        router.thread.router.drain()
        while b"data: [DONE]" not in received:
            received += sock.recv(65536)
    events = sse_events(received.decode())
    error = events[-2]["error"]
    request_id = events[0]["id"]
    assert error["code"] == 503 and f"/v1/requests/{request_id}/resume" in error["message"]
    sent = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert _stopped(router)
    # The tokens it had committed are in the registry: another replica goes on from them.
    code, record = get(f"{open_router.url}/v1/requests/{request_id}")
    assert code == 200 and record["finish_reason"] == "abort"
    assert 0 < len(record["token_ids"]) < body["max_tokens"]
    code, resumed, _, _ = post(f"{open_router.url}/v1/requests/{request_id}/resume", b"")
    assert code == 200 and resumed["resumed"]["committed_tokens"] == len(record["token_ids"])
    _, whole, _, _ = post(f"{open_router.url}/v1/completions", body)
    text = resumed["choices"][0]["text"]
    assert text == whole["choices"][0]["text"] and text.startswith(sent)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One `outrider serve` for the module's last tests (the last one stops it with SIGTERM)."""
    running = Served()
    yield running
    running.stop()


@pytest.mark.slow
def test_a_load_test_of_outrider_serve_writes_its_figures(served: Served, tmp_path: Path) -> None:
    """`python -m load_tests run` against `outrider serve`: report.html opens without network
    access (no script, no fetched file: inline SVG) and each figure holds the run's data."""
    from load_tests import html_report, report
    from load_tests.__main__ import main

    argv = ["run", "--url", served.url, "--workload", small_workload(tmp_path)]
    argv += ["--concurrency", "1,2", "--requests", "3", "--max-tokens", "8", "--warmup", "0"]
    assert main([*argv, "--spec-method", "ngram", "--out", str(tmp_path)]) == 0
    page = (tmp_path / report.HTML_REPORT).read_text()
    assert "<script" not in page and not re.search(r"""(src|href)\s*=\s*["']?\w+:""", page)
    assert re.findall(r"@import|url\((?!#)", page) == []  # clip paths point inside the page
    figures = dict(re.findall(r'<figure id="([a-z-]+)" data-points="(\d+)">', page))
    assert list(figures) == list(html_report.FIGURES)
    requests = 6
    assert int(figures["throughput"]) == 2 * 2  # two levels, tokens/s and requests/s
    assert int(figures["latency-percentiles"]) >= 2 * 3 * 2  # TTFT/TPOT: 2 levels x 3 quantiles
    assert int(figures["latency-distribution"]) == 2 * requests  # latency and TTFT per request
    assert int(figures["acceptance"]) == 2
    assert int(figures["timeline"]) == requests
    for level in ("1 user", "2 users"):  # the load axis names the levels, as text
        assert page.count(f">{level}<") >= 4
    result = report.load(tmp_path)
    top = max(s.output_tokens_per_s for s in result.summaries())
    assert top > 0 and f"{top:.1f}" in page  # the summary table beside the figures


@pytest.mark.slow
def test_sigterm_drains_outrider_serve_then_it_cleans_up_and_exits(served: Served) -> None:
    """The real signal path: `outrider serve` in a subprocess gets SIGTERM mid-stream; the
    stream runs to its end, the process exits 0, and its embedded redis-server is gone."""
    proc, redis_port = served.proc, served.redis_port
    assert redis_port is not None
    body = {**LONG, "max_tokens": 64}
    received = b""
    with raw_completion_stream(served.port, body) as sock:
        while received.count(b"data: ") < 4:
            received += sock.recv(65536)
        proc.send_signal(signal.SIGTERM)
        while b"data: [DONE]" not in received:
            received += sock.recv(65536)
    events = sse_events(received.decode())
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "shutting down: 1 requests in flight" in rest
    with pytest.raises(OSError):  # the embedded Redis went with it
        socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
