"""`outrider generate --cluster` runs one request through a local disaggregated runtime and
prints the in-process JSON plus which actors served it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def run_generate(*flags: str) -> dict:  # type: ignore[type-arg]
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "def add(a, b):", "--json"]
    cmd += ["--temperature", "0", "--max-tokens", "12", "--dtype", "float32", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generate_on_the_cluster_matches_in_process() -> None:
    local = run_generate("--spec-method", "ngram")
    remote = run_generate(
        "--cluster", "--spec-method", "draft_model", "--draft-layers", "6", "--drafters", "1"
    )
    assert remote["token_ids"] == local["token_ids"]
    assert remote["text"] == local["text"]
    assert remote["served_by"] == {
        "prefill": None,
        "verifier": ["verifier-g0-r0"],
        "drafter": "drafter-0",
    }
    assert set(remote["spec"]) == {"drafted", "accepted", "mean_acceptance_length", "verify_steps"}
