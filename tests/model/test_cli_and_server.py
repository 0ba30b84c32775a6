"""`outrider generate` in a subprocess, and the interim HTTP server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from router.simple_server import make_server
from workers.drafting.ngram import NgramDrafter
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.factory import LoadedEngine
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "cluster.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


def test_generate_json_matches_the_engine(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli(PROMPT, "--temperature", "0", "--max-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    keys = {"text", "prompt_token_ids", "token_ids", "finish_reason", "tokens_per_s", "spec"}
    assert set(out) == keys
    ids = checkpoint.tokenizer.encode(PROMPT)
    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=256
    )
    expected = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0))
    assert out["prompt_token_ids"] == ids
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == checkpoint.tokenizer.decode(expected.token_ids)
    assert out["finish_reason"] == "length" and out["tokens_per_s"] > 0
    assert out["spec"] == {
        "drafted": 0,
        "accepted": 0,
        "mean_acceptance_length": 1.0,
        "verify_steps": 11,
    }
    assert "loading weights" in proc.stderr  # the progress bar


def test_generate_with_speculation_gives_the_same_tokens(checkpoint) -> None:  # type: ignore[no-untyped-def]
    prompt = "A B C D E F G A B C D E F G A B C"
    base = ["--temperature", "0", "--max-tokens", "16", "--json", "--ignore-eos"]
    plain = json.loads(run_cli(prompt, *base).stdout)
    for extra in (
        ["--spec-method", "ngram"],
        ["--spec-method", "draft_model", "--draft-layers", "10"],
    ):
        proc = run_cli(prompt, *base, *extra, "--num-spec-tokens", "3", "--no-adaptive")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["token_ids"] == plain["token_ids"]
        assert out["spec"]["drafted"] > 0  # it did speculate (whatever was accepted)
        assert out["spec"]["verify_steps"] + out["spec"]["accepted"] == 15


def test_generate_rejects_bad_parameters() -> None:
    proc = run_cli(PROMPT, "--top-p", "0", "--json")
    assert proc.returncode == 2
    assert "top_p must be in (0, 1]" in proc.stderr
    proc = run_cli(PROMPT, "--spec-method", "draft_model")
    assert proc.returncode == 2
    assert "needs --draft-model or --draft-layers" in proc.stderr


@pytest.fixture(scope="module")
def served(model_fp32, checkpoint) -> Iterator[tuple[str, LLMEngine]]:  # type: ignore[no-untyped-def]
    config = EngineConfig(max_model_len=256, spec=SpecConfig(method="none"))
    engine = LLMEngine(
        model_fp32,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.config.eos_token_ids,
        drafters={"ngram": NgramDrafter()},
    )
    httpd, loop = make_server(LoadedEngine(engine, checkpoint.tokenizer, "smol"), "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", engine
    httpd.shutdown()
    httpd.server_close()
    loop.close()


@pytest.fixture(scope="module")
def server(served: tuple[str, LLMEngine]) -> str:
    return served[0]


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
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        5,
        10,
        15,
    )
    assert usage["speculative"]["verify_steps"] == 9
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
        ({"prompt": PROMPT, "stop": 3}, 400, "'stop'"),
        ({"prompt": PROMPT, "speculative": {"method": "magic"}}, 400, "speculative method"),
        ({"prompt": PROMPT, "speculative": {"method": "draft_model"}}, 400, "not available"),
        ({"prompt": PROMPT, "speculative": {"k": 3}}, 400, "'speculative' takes"),
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


def test_a_client_that_leaves_mid_stream_is_aborted_and_frees_its_blocks(
    served: tuple[str, LLMEngine],
) -> None:
    server, engine = served
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()  # aborted long before 200 tokens
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks
    status, out, _ = post(server + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server: str) -> None:
    prompts = [PROMPT, "Once upon a time", "def fib(n):", "The best way to learn is"]
    alone = [
        post(server + "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})[1]
        for p in prompts
    ]
    results: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        results[i] = post(
            server + "/v1/completions", {"prompt": prompts[i], "max_tokens": 8, "temperature": 0}
        )[1]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["choices"][0]["text"] for r in results] == [a["choices"][0]["text"] for a in alone]


def test_speculative_extension_field(server: str) -> None:
    body = {"prompt": "A B C D A B C D A B C", "max_tokens": 12, "temperature": 0}
    _, plain, _ = post(server + "/v1/completions", body)
    _, spec, _ = post(server + "/v1/completions", {**body, "speculative": {"method": "ngram"}})
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec["usage"]["speculative"]["drafted"] > 0
    assert plain["usage"]["speculative"]["drafted"] == 0
    _, off, _ = post(server + "/v1/completions", {**body, "speculative": {"enabled": False}})
    assert off["usage"]["speculative"]["drafted"] == 0


def test_server_chat_stream_opens_with_the_assistant_role(server: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    _, whole, _ = post(server + "/v1/chat/completions", body)
    _, _, raw = post(server + "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_health_ready_and_models(server: str) -> None:
    for path, key, value in (
        ("/health", "status", "ok"),
        ("/ready", "status", "ready"),
        ("/v1/models", "object", "list"),
    ):
        with urllib.request.urlopen(server + path, timeout=10) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())[key] == value
