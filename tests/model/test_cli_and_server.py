"""`outrider generate` in a subprocess, and the interim HTTP server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from router.simple_server import Handler, Service
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_generate_json_matches_the_engine(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "generate",
        PROMPT,
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "prompt_token_ids", "token_ids", "finish_reason", "tokens_per_s"}
    ids = checkpoint.tokenizer.encode(PROMPT)
    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256
    )
    expected = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0))
    assert out["prompt_token_ids"] == ids
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == checkpoint.tokenizer.decode(expected.token_ids)
    assert out["finish_reason"] == "length" and out["tokens_per_s"] > 0
    assert "loading weights" in proc.stderr  # the progress bar


def test_generate_rejects_bad_parameters() -> None:
    cmd = [sys.executable, "-m", "cluster.cli", "generate", PROMPT, "--top-p", "0", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "top_p must be in (0, 1]" in proc.stderr


@pytest.fixture(scope="module")
def server(model_fp32, checkpoint) -> Iterator[str]:  # type: ignore[no-untyped-def]
    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256
    )
    service = Service(engine, checkpoint.tokenizer, "smol")
    handler = type("TestHandler", (Handler,), {"service": service})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def post(url: str, body: bytes | dict[str, Any]) -> tuple[int, Any, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
            return resp.status, (json.loads(raw) if not raw.startswith("data:") else None), raw
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode()), ""


def test_server_completion_and_stream_agree(server: str, checkpoint) -> None:  # type: ignore[no-untyped-def]
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    status, out, _ = post(server + "/v1/completions", body)
    assert status == 200
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
    status, _, raw = post(server + "/v1/completions", {**body, "stream": True})
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == out["choices"][0]["text"]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_server_chat_uses_the_template(server: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    status, out, _ = post(server + "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] > 20  # the template's system prompt is there


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": PROMPT, "temperature": "hot"}, 400, "'temperature' must be a number"),
        ({"prompt": PROMPT, "max_tokens": 1.5}, 400, "integer"),
        ({"prompt": ""}, 400, "'prompt'"),
        ({"prompt": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
        ({"prompt": "word " * 400}, 400, "the context holds"),
    ],
)
def test_server_bad_requests_get_openai_errors(
    server: str, body: Any, status: int, message: str
) -> None:
    code, out, _ = post(server + "/v1/completions", body)
    assert code == status
    assert message in out["error"]["message"]
    assert out["error"]["type"]
    # ... and the server keeps serving.
    ok, _, _ = post(server + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert ok == 200


def test_server_survives_a_client_that_leaves_mid_stream(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 60, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    status, out, _ = post(server + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3


def test_server_chat_stream_opens_with_the_assistant_role(server: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    _, whole, _ = post(server + "/v1/chat/completions", body)
    _, _, raw = post(server + "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
