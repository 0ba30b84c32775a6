"""Markdown tables and the sections of docs/benchmarks.md that each benchmark owns."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import native
from load_tests.report import cpu_name
from load_tests.report import table as table  # the benchmarks take their tables from here

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options the single-stream benchmarks share: rounds, answer length, torch threads,
    a tiny `--quick` run for the smoke tests, the report to write."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    return parser


def bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options (`--quick`: one round of 8 tokens), torch's threads set."""
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens = 1, 8
    torch.set_num_threads(args.threads)
    return args


_HEADER = (
    "# Benchmarks\n\n"
    "Each section is written by the script it names; rerun the script to refresh it. "
    "Numbers are medians of several runs measured side by side in one process on the machine "
    "named in the section (these machines are noisy: compare ratios, not absolute times).\n"
)


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_line() -> str:
    return (
        f"{cpu_name()} ({cpu_features()}), {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def cpu_section(name: str) -> tuple[str, str]:
    """A benchmark's section name in docs/benchmarks.md and its title's suffix for this CPU: one
    without bf16 instructions (our avx512f build) gets sections of its own, beside those
    measured where they are, as the two differ several times over."""
    if native.variant() == "avx512f":
        return f"{name}_avx512f", " on a CPU without AVX512-BF16"
    return name, ""


def cpu_features() -> str:
    """What decides our CPU kernels' speed: the bf16 instructions, and which build runs."""
    if native.amx_available():
        return "AMX, AVX512-BF16"
    variant = native.variant()
    if variant == "avx512_bf16":
        return "AVX512-BF16, no AMX"
    if variant == "avx512f":
        return "AVX512F without AVX512-BF16 or AMX"
    return f"our native kernels unavailable: {native.unavailable_reason()}"


def write_section(name: str, body: str, path: Path = DEFAULT_REPORT) -> None:
    """Replace (or append) the section between this benchmark's markers."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.is_file() else _HEADER
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
