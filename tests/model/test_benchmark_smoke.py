"""The benchmark script runs end to end (tiny sizes) and writes its section."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmarks.bench_spec import Run, paired_ratio
from tests.benchmarks.report import write_section
from workers.engine.outputs import Completion

pytestmark = [
    pytest.mark.slow,
    # runpy notes that this module imported bench_spec before it runs it as __main__.
    pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning"),
]


def run_script(script: str, *argv: str) -> None:
    """`python -m tests.benchmarks.<script> ARGV`, run as __main__ in this process (no new
    interpreter, and torch and transformers already imported)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [script, *argv])
        runpy.run_module(f"tests.benchmarks.{script}", run_name="__main__", alter_sys=True)


def quick_run(script: str, tmp_path: Path) -> str:
    """Run `tests.benchmarks.<script> --quick` into a scratch report; the report's text."""
    out = tmp_path / "benchmarks.md"
    run_script(script, "--quick", "--output", str(out))
    return out.read_text()


def test_write_section_replaces_only_its_own_block(tmp_path: Path) -> None:
    report = tmp_path / "b.md"
    write_section("a", "first", report)
    write_section("b", "other", report)
    write_section("a", "second", report)
    text = report.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert text.index("second") < text.index("other")


def test_bench_host_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = quick_run("bench_host", tmp_path)
    assert "<!-- bench_host:start -->" in text and "| greedy | 64 |" in text
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for mode in ("greedy", "sampled", "greedy, async scheduling"):
        assert set(last[mode]) == {"16", "64"}
        assert all(row["us_per_seq"] > 0 for row in last[mode].values())


def test_bench_eagle_gap_quick_run(tmp_path: Path) -> None:
    """Its rows come out for both kinds (the script itself checks that the gap leaves the
    tokens as they were)."""
    text = quick_run("bench_eagle_gap", tmp_path)
    assert "<!-- bench_eagle_gap:start -->" in text
    assert "| chat | 1 |" in text and "| code | 1 |" in text


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


def test_bench_grace_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_grace", tmp_path)
    assert "<!-- grace_estimate:start -->" in text and "An estimate, not a measurement" in text
    assert "| EAGLE-3 head, Llama-3.1-8B shape, all q8_0 | 397.7 |" in text


def test_bench_spec_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_spec", tmp_path)
    assert "<!-- bench_spec:start -->" in text or "<!-- bench_spec_avx512f:start -->" in text
    assert "| code edit | ngram |" in text and "| 4 | draft_model |" in text
    assert "| summary | transformers prompt lookup, 16 tokens |" in text
    assert "n-gram on code edit vs none" in text


def test_bench_gpu_engine_parts_on_the_cpu_and_its_report(tmp_path: Path) -> None:
    """The GPU benchmark's engine parts run on the CPU (no graphs there; EAGLE trees priced as
    served), and its section renders from the stored H200 runs and this one's."""
    root = Path(__file__).resolve().parents[2]
    parts = ["--device", "cpu", "--quick", "--parts"]
    parts += ["environment,engine,single,concurrency,deterministic"]
    parts += ["--tree-nodes", "8"]  # EAGLE drafts trees where they pay
    run_script("bench_gpu", *parts, "--out", str(tmp_path))
    results = json.loads((tmp_path / "gpu.json").read_text())
    for part in ("engine", "single", "concurrency", "deterministic"):
        assert "error" not in results[part], results[part]
    # Our CPU kernels give every row its own bits: no text changes in a batch, either mode.
    same = results["deterministic"]["same_text"].values()
    assert all(s["differ_together"] == s["differ_ngram"] == 0 for s in same)
    assert set(results["single"]["tokens_per_s"]["code edit"]) == {"none", "ngram", "eagle"}
    assert results["concurrency"]["vs_none"]["4"]["none"] == 1.0
    report = tmp_path / "benchmarks.md"
    runs = [
        str(root / "docs" / "bench_gpu" / name) for name in ("h200-k4.json", "h200-k4-fixed.json")
    ]
    run_script("bench_gpu", "--render", *runs, str(tmp_path / "gpu.json"), "--output", str(report))
    text = report.read_text()
    assert "<!-- bench_gpu:start -->" in text and "| goal | measured | target | met |" in text
    assert "With exactly 4 draft tokens a step" in text
    assert "--tree-nodes 8 --parts" in text and "eagle" in results["engine"]["tree_costs"]
    assert "Every request 8 tokens (EOS ignored), no speculation: 1 requests" in text
    assert "### Deterministic kernels" in text and "| 64 concurrent, none |" in text
    ratio = results["concurrency"]["vs_none"]["4"]["eagle"]
    assert "| 4 | " in text and f"({ratio:.2f}x) |" in text  # this run's concurrency table


def test_profile_draft_loop_runs_on_the_cpu(tmp_path: Path) -> None:
    """The draft loop's profile (a GPU script) runs its loop eagerly on the CPU."""
    argv = ["--device", "cpu", "--k", "2", "--reps", "1", "--out", str(tmp_path)]
    run_script("profile_draft_loop", *argv)
    results = json.loads((tmp_path / "draft_loop.json").read_text())
    assert set(results["batch_4"]) == {"1", "2"}
    assert all(t["proposal_ms"] > 0 for t in results["batch_1"].values())
    assert set(results["catch_up_ms"]) == {"8", "64", "256"}
    from tests.benchmarks.bench_gpu_report import catch_up_lines

    (line,) = catch_up_lines(results)
    assert "256 rows" in line


def runs_at(*tokens_per_s: float) -> list[Run]:
    return [Run(90 / t, [Completion("r", [1], [0] * 90)]) for t in tokens_per_s]


def test_a_speed_up_is_the_median_of_the_ratios_within_runs() -> None:
    # The machine ran slow for the method's second run and fast for the base's: the ratio of
    # medians (9 / 15) would call the method 0.6x; within each run it is 0.9x twice.
    method, base = runs_at(9, 4.5, 13.5), runs_at(10, 16, 15)
    assert paired_ratio(method, base) == pytest.approx(0.9)


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
    assert "| one request, n = 4 |" in text and "| 4 requests at once |" in text


def test_bench_structured_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_structured", tmp_path)
    assert "<!-- bench_structured:start -->" in text
    assert "| eagle | schema |" in text and "| eagle | tool call |" in text


def test_bench_prediction_quick_run(tmp_path: Path) -> None:
    text = quick_run("bench_prediction", tmp_path)
    assert "<!-- bench_prediction:start -->" in text
    assert "| chat, asked again | ngram | right |" in text
    assert "| code edit | eagle | none |" in text


def test_bench_quant_quick_run(tmp_path: Path) -> None:
    """Beside llama.cpp where llama-cpp-python is installed (the quick run installs nothing)."""
    text = quick_run("bench_quant", tmp_path)
    assert "<!-- bench_quant:start -->" in text or "<!-- bench_quant_avx512f:start -->" in text
    assert "| code edit | Outrider plain, GGUF blocks |" in text
    assert "| code edit | Outrider ngram, GGUF blocks |" in text
    assert "| code edit | Outrider plain, bf16 weights |" in text


def test_bench_gpu_8b_shape_part_on_a_small_shape() -> None:
    """bench_gpu's 8B-shaped part, on a small shape on the CPU: its decode steps are timed
    apart from its prefill steps, also with async scheduling."""
    from tests.benchmarks.bench_gpu_8b import eight_b
    from tests.factories import tiny_config

    shape = tiny_config(max_position_embeddings=1024, vocab_size=512)
    for overlap in (False, True):
        result = eight_b(torch.device("cpu"), 10.0, 8, shape, async_scheduling=overlap)
        for batch in ("1", "64"):
            decode = result["decode"][batch]
            assert decode["decode_step_ms"] > 0 and decode["prefill_steps"] >= 1
        assert result["decode"]["64"]["prefill_steps"] <= 4  # 64 x 128 prompt tokens, 2048 a step


def test_bench_output_channel_quick_run(tmp_path: Path) -> None:
    """Both ways deliver every output (the script checks the counts) on a local Ray cluster."""
    pytest.importorskip("ray")
    text = quick_run("bench_output_channel", tmp_path)
    assert "<!-- bench_output_channel:start -->" in text and "\n| 16 | " in text
