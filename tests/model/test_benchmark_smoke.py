"""The benchmark script runs end to end (tiny sizes) and writes its section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.report import write_section

pytestmark = pytest.mark.slow


def quick_run(script: str, tmp_path: Path) -> str:
    """Run `tests.benchmarks.<script> --quick` into a scratch report; the report's text."""
    out = tmp_path / "benchmarks.md"
    cmd = [sys.executable, "-m", f"tests.benchmarks.{script}", "--quick", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out.read_text()


def test_write_section_replaces_only_its_own_block(tmp_path: Path) -> None:
    report = tmp_path / "b.md"
    write_section("a", "first", report)
    write_section("b", "other", report)
    write_section("a", "second", report)
    text = report.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert text.index("second") < text.index("other")


def test_bench_forward_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_forward", tmp_path)
    # Its own section on a CPU without AVX512-BF16 (see the script's main).
    assert "<!-- bench_forward:start -->" in text or "<!-- bench_forward_avx512f:start -->" in text
    for heading in (
        "Decode speed vs transformers",
        "Forward cost by number",
        "Projection kernels for few rows",
        "Prefill attention over whole KV blocks",
    ):
        assert heading in text
    assert "| bfloat16 | 8 |" in text and "dense HF folder" in text and "packed weights" in text


def test_bench_eagle_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_eagle", tmp_path)
    assert "<!-- bench_eagle:start -->" in text
    assert "| chat | eagle, k=4 |" in text and "| summary | none |" in text
    assert "eagle mean acceptance length at k = 4" in text


def test_bench_router_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_router", tmp_path)
    assert "<!-- bench_router:start -->" in text
    assert "| 1 | direct |" in text and "| 2 | HTTP (openai client) |" in text
    assert "| 2 | gRPC |" in text
