"""`outrider generate --cluster` runs one request through a local disaggregated runtime and
prints the in-process JSON plus which actors served it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.otlp import OtlpReceiver

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


# The defaults (bf16 over the GGUF's quantized blocks): on our kernels a token's logits do not
# depend on the batch, so the cluster's draft model and the in-process n-gram commit alike.
ARGS = ["generate", "def add(a, b):", "--json", "--temperature", "0", "--max-tokens", "12"]


def run_generate(*flags: str) -> dict:  # type: ignore[type-arg]
    """`outrider generate` in its own process (a cluster run starts and stops its own Ray)."""
    cmd = [sys.executable, "-m", "router.cli", *ARGS, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_in_process(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:  # type: ignore[type-arg]
    """The same command with its engine in this process (no Ray): no interpreter to start."""
    from router.cli import main

    capsys.readouterr()
    assert main([*ARGS, *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_on_the_cluster_matches_in_process(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """And its traces reach an OTLP receiver whole: the request's span and every verify round
    the run counted, though the actors that made them end with the command (each process
    flushes its spans before it stops)."""
    local = run_in_process(capsys, "--spec-method", "ngram")
    receiver = OtlpReceiver()
    config = tmp_path / "outrider.yaml"
    config.write_text(f"telemetry:\n  otlp_endpoint: {receiver.url}\n")
    try:
        remote = run_generate(
            "--config", str(config), "--spec-method", "draft_model", "--draft-layers", "6",
            "--drafters", "1",
        )  # fmt: skip
    finally:
        receiver.close()
    assert receiver.names.count("outrider.request") == 1
    assert receiver.names.count("outrider.verify_round") == remote["spec"]["verify_steps"] > 0
    assert remote["token_ids"] == local["token_ids"]
    assert remote["text"] == local["text"]
    assert remote["served_by"] == {
        "prefill": None,
        "verifier": ["verifier-g0-r0"],
        "drafter": "drafter-0",
    }
    assert set(remote["spec"]) == {"drafted", "accepted", "mean_acceptance_length", "verify_steps"}


def test_tp_and_prefill_flags_set_the_pools() -> None:
    from router.cli import _uses_cluster, deployment_of
    from router.cli_args import build_parser

    def config(*flags: str):  # type: ignore[no-untyped-def]
        args = build_parser().parse_args(["generate", "hi", *flags])
        assert _uses_cluster(args)  # either flag implies --cluster
        return deployment_of(args)

    remote = config("--tp", "2", "--prefill", "remote").pools
    assert remote.verifier.tensor_parallel_size == 2
    assert remote.prefill.replicas == 1 and remote.prefill.min_remote_prompt_tokens == 1
    assert config("--prefill", "local").pools.prefill.replicas == 0
    default = config("--cluster").pools
    assert default.verifier.tensor_parallel_size == 1
    assert default.prefill.min_remote_prompt_tokens > 1  # the config's threshold stands


def test_generate_on_a_tensor_parallel_group_with_remote_prefill() -> None:
    """`--tp 2 --prefill remote`: the prefill worker computes the prompt as the group does,
    rank 0 passes rank 1 its KV heads, and the output is that of the in-process engine whose
    model sums its row-parallel projections as two ranks do (`emulate_row_parallel`): in bf16
    over blocks a group of two ranks is other bits than one process, and the same bits as its
    emulation."""
    from router.cli import load
    from router.cli_args import build_parser
    from workers.engine.sampling_params import SamplingParams
    from workers.model.tensor_parallel import emulate_row_parallel

    remote = run_generate(
        "--tp", "2", "--prefill", "remote", "--spec-method", "draft_model", "--draft-layers", "6"
    )
    local = load(build_parser().parse_args([*ARGS, "--spec-method", "ngram"]), progress=False)
    emulate_row_parallel(local.engine.runner.model, 2)
    prompt = local.tokenizer.encode(ARGS[1])
    (expected,) = local.engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert remote["prompt_token_ids"] == prompt
    assert remote["token_ids"] == expected.token_ids
    assert remote["served_by"] == {
        "prefill": "prefill-0",
        "verifier": ["verifier-g0-r0", "verifier-g0-r1"],
        "drafter": "drafter-0",
    }
