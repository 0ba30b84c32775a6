"""The offline GPU check: every CUDA test, then bench_gpu's parts, into one folder and one table.

    make test-gpu                                  # python3 -m tests.gpu_check --out gpu-check
    python3 -m tests.gpu_check --out DIR --minutes 8 --only tests,chains
    python3 -m tests.gpu_check --out DIR --device cpu --quick   # a dry run of the plumbing

Needs only torch, Triton, transformers, numpy and pytest on the host, plus the wheels and model
`python -m tests.gpu_bundle` carries (gguf, llguidance, the bundled GGUF): the CUDA test modules
import neither Ray, FastAPI, Redis nor OpenTelemetry (tests/unit/test_gpu_check.py holds them
to it), and this script is stdlib only. In this order, each with its share of `--minutes`:

| part | what |
| --- | --- |
| tests | `pytest -m cuda` over `CUDA_TEST_MODULES` |
| chains | bench_gpu: forward costs, single stream, concurrency (none, ngram, eagle), transformers |
| trees | the same engine parts with EAGLE drafting trees (`--k 6 --tree-nodes 32`) |
| async | the engine parts with `--async-scheduling` |
| deterministic | `--deterministic` beside the default kernels |
| llama_8b | a Llama-3.1-8B-shaped model's forward and served decode step, async scheduling on |

Writes four files (the device tool brings back at most eight): `check.json` (each part's
status, seconds and bench_gpu results), `check.log` (everything printed), `pytest.xml`, and
`summary.md`, the table this prints. A part that fails or runs out of time is recorded and the
next one runs; `--only` reruns some.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Every test module with CUDA tests that one GPU runs. tests/cluster/test_links.py's CUDA
# cases (NCCL between two GPUs) need a second GPU and Ray's test fixtures: not here.
CUDA_TEST_MODULES = (
    "tests/unit/test_cuda.py",
    "tests/unit/test_async_scheduling.py",
    "tests/unit/test_attention.py",
    "tests/unit/test_attention_uniform.py",
    "tests/unit/test_batch_invariant.py",
    "tests/unit/test_device_sampler.py",
    "tests/unit/test_eagle_loop.py",
    "tests/unit/test_fused_triton.py",
    "tests/unit/test_tree_attention.py",
)
NOT_ON_ONE_GPU = {"tests/cluster/test_links.py": "NCCL links between two GPUs"}
ENGINE = "engine,single,concurrency"
# (part, bench_gpu's arguments, share of the budget)
BENCH_PARTS: tuple[tuple[str, list[str], float], ...] = (
    ("chains", ["--parts", f"environment,forward,{ENGINE},hf"], 0.30),
    ("trees", ["--parts", ENGINE, "--k", "6", "--tree-nodes", "32", "--skip-hf"], 0.15),
    ("async", ["--parts", ENGINE, "--async-scheduling", "--skip-hf"], 0.15),
    ("deterministic", ["--parts", "deterministic", "--skip-hf"], 0.12),
    ("llama_8b", ["--parts", "environment,llama_8b_shape", "--async-scheduling"], 0.10),
)
TESTS_SHARE = 0.18


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> tuple[str, float]:
    """Run `cmd` from the repo's root, its output appended to `log`: ("ok" | "failed" |
    "timeout", seconds)."""
    start = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=max(timeout_s, 1.0), env=_env())  # fmt: skip
            status = "ok" if done.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
    return status, round(time.monotonic() - start, 1)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def run_tests(out: Path, log: Path, timeout_s: float, python: str) -> dict[str, Any]:
    junit = out / "pytest.xml"
    cmd = [python, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *CUDA_TEST_MODULES]  # fmt: skip
    status, seconds = run_logged(cmd, log, timeout_s)
    counts = junit_counts(junit) if junit.is_file() else {}
    if status == "ok" and not counts.get("tests"):
        status = "failed"  # nothing ran: a host without CUDA
    return {"status": status, "seconds": seconds, **counts}


def junit_counts(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: int(suite.get(k, 0)) for k in keys}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed_tests": failed}


def run_bench(
    name: str, args: list[str], log: Path, timeout_s: float, python: str, device: str, quick: bool
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-m", "tests.benchmarks.bench_gpu", "--out", tmp, "--device", device, *args]
        cmd += ["--quick"] if quick else []
        status, seconds = run_logged(cmd, log, timeout_s)
        result = Path(tmp) / "gpu.json"
        data = json.loads(result.read_text()) if result.is_file() else {}
    errors = [part for part, value in data.items() if isinstance(value, dict) and "error" in value]
    if status == "ok" and errors:
        status = "failed"
    return {"status": status, "seconds": seconds, "errors": errors, "results": data}


def headline(name: str, part: dict[str, Any]) -> str:
    """One line of what a part measured, for the table."""
    if name == "tests":
        return ", ".join(
            f"{k} {part.get(k, 0)}" for k in ("tests", "failures", "errors", "skipped")
        )
    results = part.get("results", {})
    single = results.get("single", {})
    rates = single.get("tokens_per_s", {}) if isinstance(single, dict) else {}
    bits = [
        f"{kind}: " + " / ".join(f"{m} {v:.0f}" for m, v in by_method.items()) + " tok/s"
        for kind, by_method in rates.items()
    ]
    if part.get("errors"):
        bits.append(f"errors in {', '.join(part['errors'])}")
    return "; ".join(bits) or "see check.json"


def summary_table(report: dict[str, Any]) -> str:
    lines = ["| part | status | seconds | measured |", "|---|---|---|---|"]
    for name, part in report["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part['seconds']} | {headline(name, part)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--minutes", type=float, default=8.0, help="the whole check's budget")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None, help="parts to run")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (with --quick)")
    parser.add_argument("--quick", action="store_true", help="bench_gpu's tiny runs")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "check.log"
    log.write_text("")
    budget = 60 * args.minutes
    wanted = args.only or ["tests", *(name for name, _, _ in BENCH_PARTS)]
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
    start = time.monotonic()
    if "tests" in wanted:
        report["parts"]["tests"] = run_tests(out, log, TESTS_SHARE * budget, args.python)
    for name, bench_args, share in BENCH_PARTS:
        if name not in wanted:
            continue
        left = budget - (time.monotonic() - start)
        timeout = min(share * budget * 1.5, left)
        report["parts"][name] = run_bench(
            name, bench_args, log, timeout, args.python, args.device, args.quick
        )
        (out / "check.json").write_text(json.dumps(report, indent=1))  # a cut run keeps it
    report["seconds"] = round(time.monotonic() - start, 1)
    (out / "check.json").write_text(json.dumps(report, indent=1))
    table = summary_table(report)
    (out / "summary.md").write_text(table)
    print(table)
    return 0 if all(p["status"] == "ok" for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
