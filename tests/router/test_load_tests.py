"""The load generator against a real router on loopback (HTTP and gRPC, real Redis, the bundled
model in an in-process engine): every request is recorded, the client's token counts agree with
the router's own counters, and refusals are counted, not fatal. The same run over the Ray
runtime is in test_router_runtime.py."""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from load_tests import report
from load_tests.__main__ import main
from router.keys import KeyLine
from tests.router.helpers import MODEL, RunningRouter, small_workload, start_router

pytestmark = pytest.mark.slow

KEY = "sk-load-test-0123"


def run(url: str, folder: Path, *extra: str, warmup: int = 1) -> report.Run:
    argv = ["run", "--url", url, "--workload", small_workload(folder), "--out", str(folder)]
    argv += ["--max-tokens", "8", "--warmup", str(warmup), "--metrics-interval", "0.2", *extra]
    assert main(argv) == 0
    result = report.load(folder)
    assert result.info["command"] == "python -m load_tests " + shlex.join(argv)
    return result


def check_agrees_with_the_router(result: report.Run, folder: Path, levels: list[str]) -> None:
    assert result.levels == levels
    for summary in result.summaries():
        assert summary.ok == summary.sent
        view = result.servers[summary.level]
        assert view is not None and view.requests == {"ok": summary.sent}
        assert view.counters["generated"] == summary.output_tokens > 0
        assert view.max_in_flight >= 1
    for record in result.records:
        assert record.ttft is not None and record.latency is not None
        assert 0 < record.ttft <= record.latency
        assert 1 <= record.output_tokens <= 8 and record.prompt_tokens > 0
        assert record.chunks[0] == pytest.approx(record.ttft, abs=1e-6)
    assert "## What the routers reported" in (folder / report.REPORT).read_text()


def test_http_levels_against_a_router(open_router: RunningRouter, tmp_path: Path) -> None:
    result = run(open_router.url, tmp_path, "--concurrency", "1,3", "--requests", "3")
    check_agrees_with_the_router(result, tmp_path, ["1 user", "3 users"])
    kinds = {r.kind for r in result.records}
    assert kinds == {"chat", "multi-turn", "completion"}


def test_conversations_carry_their_history(open_router: RunningRouter, tmp_path: Path) -> None:
    result = run(open_router.url, tmp_path, "--concurrency", "2", "--requests", "3", "--turns", "2")
    check_agrees_with_the_router(result, tmp_path, ["2 users, 2 turns"])
    records = result.records
    assert {r.turn for r in records if r.kind == "completion"} <= {1}  # no next turn
    chats = [r for r in records if r.turn == 1 and r.kind != "completion"]
    assert chats and sum(r.turn == 2 for r in records) == len(chats)
    for first, second in itertools.pairwise(records):
        if second.turn == 2:  # the history, the answer and a question came back
            assert second.prompt_tokens > first.prompt_tokens + first.output_tokens
    assert "## By turn of a conversation" in (tmp_path / report.REPORT).read_text()


def test_grpc_at_a_poisson_rate(open_router: RunningRouter, tmp_path: Path) -> None:
    grpc_target = f"127.0.0.1:{open_router.grpc_port}"
    result = run(
        open_router.url,
        tmp_path,
        *("--api", "grpc", "--grpc-target", grpc_target),
        *("--rate", "20", "--max-concurrency", "2", "--requests", "4"),
    )
    check_agrees_with_the_router(result, tmp_path, ["20 req/s, <= 2 in flight"])
    assert {r.api for r in result.records} == {"grpc"}


@pytest.fixture(scope="module")
def keyed_router(local_engine, checkpoint, redis_server) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    """A router whose only key allows a burst of 2 requests and then almost nothing."""
    from router.backends import LocalBackend

    keys = [KeyLine(KEY, "tight", 0.001, 2)]
    running = start_router(
        LocalBackend(local_engine), checkpoint.tokenizer, redis_server, db=9, keys=keys
    )
    yield running
    running.stop()


def test_refusals_are_counted_and_the_run_goes_on(
    keyed_router: RunningRouter, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(
        keyed_router.url,
        tmp_path,
        # --model: asking the router for it would take one of the key's two requests.
        *("--api-key", KEY, "--model", MODEL, "--concurrency", "1", "--requests", "5"),
        warmup=0,
    )
    (summary,) = result.summaries()
    assert (summary.sent, summary.ok, summary.refused) == (5, 2, {"429": 3})
    view = result.servers["1 user"]
    assert view is not None and view.requests == {"ok": 2, "refused": 3}
    assert "3x 429" in (tmp_path / report.REPORT).read_text()
    # As a smoke test: any refusal beyond --max-refused is exit status 1 (the bucket is empty).
    smoke = ["run", "--url", keyed_router.url, "--api-key", KEY, "--model", MODEL, "--warmup"]
    smoke += ["0", "--requests", "1", "--max-refused", "0", "--out", str(tmp_path / "smoke")]
    assert main(smoke) == 1
    # A wrong key is refused before any level runs: a clear error, exit status 2.
    wrong = ["run", "--url", keyed_router.url, "--api-key", "sk-wrong", "--out", str(tmp_path)]
    assert main(wrong) == 2
    assert "answered 401" in capsys.readouterr().err


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_random_prompts_of_set_lengths_in_bursts(
    open_router: RunningRouter, tmp_path: Path, api: str
) -> None:
    """Synthetic token-id prompts: the router sees exactly the lengths asked for."""
    argv = ["run", "--url", open_router.url, "--out", str(tmp_path), "--warmup", "0"]
    argv += ["--random-input-len", "12", "--random-output-len", "4", "--ignore-eos"]
    argv += ["--rate", "50", "--burstiness", "0.5", "--requests", "4", "--api", api]
    argv += ["--grpc-target", f"127.0.0.1:{open_router.grpc_port}", "--metrics-url", "none"]
    assert main(argv) == 0
    result = report.load(tmp_path)
    assert result.levels == ["50 req/s, burstiness 0.5"]
    assert len(result.records) == 4
    for record in result.records:
        assert record.ok and record.kind == "random"
        assert (record.prompt_tokens, record.output_tokens) == (12, 4)
    assert "random token ids in [1000, 32000)" in (tmp_path / report.REPORT).read_text()
