"""A router replica shutting down (SIGTERM from Kubernetes, Ctrl-C): `Router.drain` refuses new
requests and fails `/ready` at once, lets the streams in flight finish within its grace period,
cuts the rest with an error that says how to resume them, and stops. Real routers over the
module's engine and Redis; a second replica (`open_router`, same Redis database) resumes a cut
request."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from router.backends import LocalBackend
from router.redis_server import free_port
from tests.router.helpers import (
    RunningRouter,
    get,
    post,
    raw_completion_stream,
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


@pytest.mark.slow
def test_sigterm_drains_outrider_serve_then_it_cleans_up_and_exits() -> None:
    """The real signal path: `outrider serve` in a subprocess gets SIGTERM mid-stream; the
    stream runs to its end, the process exits 0, and its embedded redis-server is gone."""
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--no-grpc"]
    cmd += ["--max-model-len", "256", "--max-num-seqs", "2"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    try:
        assert proc.stdout is not None
        redis_port = None
        for line in proc.stdout:  # until it serves
            found = re.search(r"embedded redis-server on redis://127\.0\.0\.1:(\d+)/", line)
            redis_port = int(found.group(1)) if found else redis_port
            if line.startswith("Outrider is serving"):
                break
        assert redis_port is not None
        deadline = time.monotonic() + 60
        while get_status(f"http://127.0.0.1:{port}/ready") != 200:  # it prints, then listens
            assert time.monotonic() < deadline and proc.poll() is None, "it never got ready"
            time.sleep(0.2)
        body = {**LONG, "max_tokens": 64}
        received = b""
        with raw_completion_stream(port, body) as sock:
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
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def get_status(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:  # not listening yet
        return None
