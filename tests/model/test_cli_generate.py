"""`outrider generate` in a subprocess (the HTTP API is tested in tests/router/)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "router.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())


def test_generate_json_matches_the_engine(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    exact = ["--dtype", "float32", "--quantization", "none"]  # the float model's own tokens
    proc = run_cli(PROMPT, "--temperature", "0", "--max-tokens", "12", "--json", *exact)
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
    base = ["--temperature", "0", "--max-tokens", "16", "--json", "--ignore-eos", "--logprobs", "2"]
    # The defaults: bf16 over the GGUF's quantized blocks, row-independent on our kernels.
    plain = json.loads(run_cli(prompt, *base).stdout)
    assert [lp["token_id"] for lp in plain["logprobs"]] == plain["token_ids"]
    assert all(len(lp["top"]) == 2 for lp in plain["logprobs"])
    for extra in (
        ["--spec-method", "ngram"],
        ["--spec-method", "draft_model", "--draft-layers", "10"],
    ):
        proc = run_cli(prompt, *base, *extra, "--num-spec-tokens", "3", "--no-adaptive")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["token_ids"] == plain["token_ids"]
        assert [lp["logprob"] for lp in out["logprobs"]] == pytest.approx(
            [lp["logprob"] for lp in plain["logprobs"]], abs=1e-4
        )
        assert out["spec"]["drafted"] > 0  # it did speculate (whatever was accepted)
        assert out["spec"]["verify_steps"] + out["spec"]["accepted"] == 15


def test_generate_holds_the_answer_to_a_grammar() -> None:
    proc = run_cli(PROMPT, "--temperature", "0", "--json", "--regex", " [A-Z][a-z]+, [0-9]{4}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert re.fullmatch(" [A-Z][a-z]+, [0-9]{4}", out["text"]) and out["finish_reason"] == "stop"
    choices = ["--choice", " Paris", "--choice", " Rome", "--spec-method", "eagle"]
    out = json.loads(run_cli(PROMPT, "--temperature", "0", "--json", *choices).stdout)
    assert out["text"] in (" Paris", " Rome")


def test_generate_rejects_bad_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any model loads, so in this process (`main` returns the exit status)."""
    from router.cli import main

    def refused(*flags: str) -> str:
        capsys.readouterr()
        assert main(["generate", PROMPT, *flags]) == 2
        return capsys.readouterr().err

    assert "top_p must be in (0, 1]" in refused("--top-p", "0", "--json")
    assert "logprobs must be in [0, 20]" in refused("--logprobs", "21")
    assert "invalid regex" in refused("--regex", "(ab")
    assert "needs --draft-model or --draft-layers" in refused("--spec-method", "draft_model")
    assert "--device is for an in-process engine" in refused("--cluster", "--device", "cpu")
    if not torch.cuda.is_available():
        assert "sees no CUDA device" in refused("--device", "cuda")
