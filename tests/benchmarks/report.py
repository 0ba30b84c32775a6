"""Markdown tables and the sections of docs/benchmarks.md that each benchmark owns."""

from __future__ import annotations

import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.transformer import TransformerLM

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
_HEADER = (
    "# Benchmarks\n\n"
    "Each section is written by the script it names; rerun the script to refresh it. "
    "Numbers are medians of several runs measured side by side in one process on the machine "
    "named in the section (these machines are noisy: compare ratios, not absolute times).\n"
)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


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


def forward_costs(
    model: TransformerLM, counts: Sequence[int], reps: int, context: int = 200
) -> list[float]:
    """Median seconds of one forward bringing n new tokens onto a `context`-token cache, for
    each n in `counts`. Rounds go over all counts in turn (machine noise lands on all alike);
    the first round warms up and is dropped."""
    block_size = 16
    num_blocks = -(-(context + max(counts)) // block_size)
    runner = ModelRunner(model, PagedKVCache(model.config, num_blocks, block_size, model.dtype))
    table_ = BlockTable(BlockAllocator(num_blocks), block_size)
    table_.prepare_write(0, context + max(counts))
    runner.forward(
        [SeqForward([(i * 7919) % 40000 + 100 for i in range(context)], 0, table_.block_ids)]
    )
    seqs = [
        SeqForward(list(range(500, 500 + n)), context, table_.block_ids, num_logits=n)
        for n in counts
    ]
    samples: list[list[float]] = [[] for _ in seqs]
    for _ in range(reps + 1):
        for seq, times in zip(seqs, samples, strict=True):
            start = time.perf_counter()
            runner.forward([seq])
            times.append(time.perf_counter() - start)
    return [statistics.median(t[1:]) for t in samples]


def machine_line() -> str:
    cpu = platform.processor() or "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        cpu = found.group(1).strip() if found else cpu
    return (
        f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )


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
