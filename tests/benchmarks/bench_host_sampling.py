"""Top-p on the CPU, bench_host's second table: what sorting every row whole costs against
looking at a row's likeliest tokens first (kernels/sampling.py `TOP_P_CANDIDATES`), side by
side in one run, over the bundled model's own answer logits at its whole vocabulary.

The transform is timed alone (`logits_to_probs`, temperature 0.8 and top-p 0.95, on 1, 16 and
64 rows), and in served decoding: an `LLMEngine` over the bundled model (bf16 over the GGUF's
blocks) answering one chat question, then 32 at once, seeded, where each way must give the same
tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

import kernels.sampling
from tests.benchmarks.report import median_time, table
from workers.engine.factory import LoadedEngine
from workers.engine.sampling_params import SamplingParams

TEMPERATURE, TOP_P = 0.8, 0.95
WAYS = ("every row sorted whole", "likeliest tokens first")


@contextmanager
def way(name: str) -> Iterator[None]:
    """Top-p on the CPU as `name` says: no candidates (every row sorted), or the kernel's."""
    candidates = () if name == WAYS[0] else kernels.sampling.TOP_P_CANDIDATES
    with mock.patch.object(kernels.sampling, "TOP_P_CANDIDATES", candidates):
        yield


def transform_rows(rows: torch.Tensor, sizes: tuple[int, ...], reps: int) -> list[list[str]]:
    """Milliseconds of the sampling transform over the first n rows, each way."""
    lines = []
    for n in sizes:
        logits = rows[:n].contiguous()
        params = (
            torch.full((n,), TEMPERATURE),
            torch.zeros(n, dtype=torch.long),
            torch.full((n,), TOP_P),
            torch.zeros(n),
        )

        def transform(logits: torch.Tensor = logits, params: tuple = params) -> torch.Tensor:
            return kernels.sampling.logits_to_probs(logits, *params)

        times = []
        for name in WAYS:
            with way(name):
                times.append(median_time(transform, reps))
        speedup = f"{times[0] / times[1]:.1f}x"
        lines.append([str(n), *(f"{t * 1e3:.2f}" for t in times), speedup])
    return lines


def served(loaded: LoadedEngine, prompts: list[list[int]], tokens: int, rounds: int) -> list[str]:
    """Tokens/s of the engine answering every prompt at once, each way, rounds interleaved
    (medians); the same seeded tokens each way, or it raises."""
    params = SamplingParams(
        max_tokens=tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=0, ignore_eos=True
    )
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    answers: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for name in WAYS:
            with way(name):
                start = time.perf_counter()
                done = loaded.engine.generate(prompts, params)
                times[name].append(time.perf_counter() - start)
            answers.setdefault(name, [c.token_ids for c in done])
    if answers[WAYS[0]] != answers[WAYS[1]]:
        raise RuntimeError("top-p from candidates drew other tokens than sorting every row")
    rates = [len(prompts) * tokens / statistics.median(times[name]) for name in WAYS]
    return [str(len(prompts)), *(f"{r:.0f}" for r in rates), f"{rates[1] / rates[0]:.1f}x"]


def top_p_section(
    rows: torch.Tensor, loaded: LoadedEngine, prompts: list[list[int]], quick: bool
) -> str:
    """The section's text: the transform alone, and (unless `quick`) served decoding."""
    sizes, reps = ((1, 16), 3) if quick else ((1, 16, 64), 20)
    header = ["rows", *(f"{name} (ms)" for name in WAYS), "speed-up"]
    text = (
        f"### Top-p over the whole vocabulary\n\nThe sampling transform (temperature "
        f"{TEMPERATURE}, top-p {TOP_P}) over rows of the bundled model's answer logits "
        f"({rows.shape[1]:,} wide), median of {reps}, every row sorted whole against each row's "
        f"likeliest {', '.join(f'{c:,}' for c in kernels.sampling.TOP_P_CANDIDATES)} tokens "
        "looked at first, in turn (`TOP_P_CANDIDATES`, kernels/sampling.py), side by side in "
        "one run:\n\n" + table(header, transform_rows(rows, sizes, reps))
    )
    if quick:
        return text
    tokens, rounds = 48, 3
    header = ["requests", *(f"{name} (tokens/s)" for name in WAYS), "speed-up"]
    return (
        text + "\n\nServed: `LLMEngine` over the bundled model (bf16 over the GGUF's blocks, no "
        f"speculation) answering one held-out chat question, then {len(prompts)} at once, "
        f"{tokens} tokens each, seeded, median of {rounds} interleaved rounds; both ways drew "
        "the same tokens.\n\n"
        + table(header, [served(loaded, batch, tokens, rounds) for batch in (prompts[:1], prompts)])
    )
