"""Starting routers on free loopback ports, and small HTTP helpers for the tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from router.keys import KeyLine
from router.redis_server import EmbeddedRedis
from router.server import Router, RouterOptions, RouterThread

MODEL = "smol"
PROMPT = "The capital of France is"


@dataclass
class RunningRouter:
    thread: RouterThread
    port: int
    grpc_port: int
    redis_url: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def service(self) -> Any:
        return self.thread.router.service

    def stop(self) -> None:
        self.thread.stop()


def start_router(
    backend: Any,
    tokenizer: Any,
    redis: EmbeddedRedis,
    db: int = 0,
    keys: list[KeyLine] | None = None,
    max_queue: int = 64,
    max_model_len: int = 256,
    block_size: int = 16,
    shutdown_grace_s: float = 30.0,
    keys_file: str | None = None,
    tls: tuple[str, str] | None = None,
    docs: bool = True,
    lease_s: float = 15.0,
) -> RunningRouter:
    """A router on ports the OS chose as it bound them (a port found free beforehand can be
    taken by another process's connection before the bind); `tls`: (certificate file, key
    file)."""
    from router.protocol import RequestBuilder

    url = f"redis://127.0.0.1:{redis.port}/{db}"
    options = RouterOptions(
        port=0,
        grpc_port=0,
        redis_url=url,
        max_queue=max_queue,
        block_size=block_size,
        api_keys=keys or [],
        api_keys_file=keys_file,
        shutdown_grace_s=shutdown_grace_s,
        tls_cert_file=None if tls is None else tls[0],
        tls_key_file=None if tls is None else tls[1],
        docs=docs,
        lease_s=lease_s,
    )
    router = Router(backend, RequestBuilder(tokenizer, MODEL, max_model_len), options)
    thread = RouterThread(router).start()
    assert router.port is not None and router.grpc_port is not None
    return RunningRouter(thread, router.port, router.grpc_port, url)


def post(
    url: str, body: bytes | dict[str, Any], key: str | None = None
) -> tuple[int, Any, str, dict[str, str]]:
    """(status, JSON body or None for a stream, raw text, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read().decode()
            stream = resp.headers.get("Content-Type", "").startswith("text/event-stream")
            parsed = None if stream else json.loads(raw)
            return resp.status, parsed, raw, {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return (
            err.code,
            json.loads(err.read().decode()),
            "",
            {k.lower(): v for k, v in err.headers.items()},
        )


def get(url: str, key: str | None = None) -> tuple[int, Any]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, json.loads(raw) if "json" in ctype else raw.decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


@contextmanager
def raw_completion_stream(
    port: int, body: dict[str, Any], path: str = "/v1/completions", key: str | None = None
) -> Iterator[socket.socket]:
    """A streaming completion (or chat completion) posted over a bare socket, which the caller
    reads from and then drops (closing it is the client leaving mid-stream)."""
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        auth = "" if key is None else f"Authorization: Bearer {key}\r\n"
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + auth.encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        yield sock


def sse_events(raw: str) -> list[Any]:
    """The JSON events of an SSE body, then the literal "[DONE]"."""
    events: list[Any] = []
    for line in raw.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def small_workload(folder: Any) -> str:
    """A load-test workload of short requests (chat, multi-turn and a raw prompt), written to
    `folder`; returns its path."""
    rows = [
        {"kind": "chat", "messages": [{"role": "user", "content": "Name a fruit."}]},
        {
            "kind": "multi-turn",
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2 + 2?"},
            ],
        },
        {"kind": "completion", "prompt": PROMPT},
    ]
    path = f"{folder}/workload.jsonl"
    with open(path, "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def plain_greedy(model_fp32, checkpoint, prompt_ids: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The bundled model's greedy tokens for a prompt, decoded plainly (fp32)."""
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.sequential import SequentialEngine

    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256
    )
    return engine.generate(prompt_ids, SamplingParams(max_tokens=n, temperature=0)).token_ids


def group_of(router: RunningRouter, request_id: str) -> str:
    """The verifier group that served a request, once the registry has its end."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        code, record = get(f"{router.url}/v1/requests/{request_id}")
        if code == 200 and record["state"] == "finished":
            return str(record["group"])
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never finished in the registry")


def routed_counts(router: RunningRouter) -> dict[tuple[str, str], float]:
    """outrider_routed_total by (group, reason), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(router.url + "/metrics")
    counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "outrider_routed_total":
                counts[(sample.labels["group"], sample.labels["reason"])] = sample.value
    return counts


def leave_mid_stream(
    router: RunningRouter, body: dict[str, Any], path: str = "/v1/completions"
) -> str:
    """Start a stream, read its first event, hang up; the request's id."""
    with raw_completion_stream(router.port, body, path) as sock:
        received = b""
        while b"data: " not in received.partition(b"\r\n\r\n")[2]:
            received += sock.recv(4096)
    head = received.partition(b"\r\n\r\n")[0].decode()
    return next(
        line.split(":", 1)[1].strip()
        for line in head.splitlines()
        if line.lower().startswith("x-request-id:")
    )


def record_when_finished(router: RunningRouter, request_id: str) -> dict[str, Any]:
    """The request's registry entry, read through `router`, once the replica serving it has
    recorded its end in Redis."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, record = get(f"{router.url}/v1/requests/{request_id}")
        if record.get("state") == "finished":
            break
        time.sleep(0.05)
    return record


def migration_count(router: RunningRouter) -> float:
    """outrider_migrations_total, from /metrics."""
    text = urllib.request.urlopen(router.url + "/metrics").read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("outrider_migrations_total")
    )


class Served:
    """`outrider serve` in a subprocess, serving (its output read up to the banner), on a port
    the OS chose as it bound (`--port 0`; the banner says which)."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", "0"]
        cmd += ["--no-grpc", "--max-model-len", "256", "--max-num-seqs", "2", *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
        )
        assert self.proc.stdout is not None
        self.redis_port = None
        self.port = 0
        output = []
        for line in self.proc.stdout:  # until it serves
            output.append(line)
            found = re.search(r"embedded redis-server on redis://127\.0\.0\.1:(\d+)/", line)
            self.redis_port = int(found.group(1)) if found else self.redis_port
            serving = re.match(r"Outrider is serving .* on http://127\.0\.0\.1:(\d+) ", line)
            if serving:
                self.port = int(serving.group(1))
                break
        assert self.port, f"it never served: {''.join(output[-20:])}"
        deadline = time.monotonic() + 60
        while get_status(f"{self.url}/ready") != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, "it never got ready"
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def get_status(url: str) -> int | None:
    try:
        return get(url)[0]
    except OSError:  # not listening yet
        return None
