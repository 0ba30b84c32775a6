"""Plain decode and forward cost of our engine, beside transformers, on the bundled model.

    python -m tests.benchmarks.bench_forward            # full run, writes docs/benchmarks.md
    python -m tests.benchmarks.bench_forward --quick    # seconds; for a smoke test

Measures, in one process and interleaved run by run:
  1. greedy decode tokens/s of `SequentialEngine` (with and without our native kernels) vs
     transformers' `generate` (bf16);
  2. forward time for 1 to 32 new tokens over a 200-token cache (bf16 with and without our
     native kernels, and fp32), the figure speculative decoding lives on: verifying k drafts
     costs what one forward over k + 1 costs;
  3. few-row projections through `F.linear`, `torch.mv`, `W @ x^T` and our kernel (why
     kernels/linear.py routes them as it does);
  4. a prompt's prefill forward with attention over exact key lengths vs whole KV blocks (why
     `SdpaAttention` pads masked calls to whole blocks);
  5. drawing a sampled token: `kernels.sampling.draw` vs `torch.multinomial`, alone and in a
     sampled decode beside greedy decode;
  6. what a request's log-probabilities and penalties cost the serving engine's decode.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar
from unittest import mock

import torch
import torch.nn.functional as F

import kernels.rejection
import kernels.sampling
from kernels import native
from kernels.attention import SdpaAttention
from kernels.linear import AMX_MAX_ROWS, NATIVE_MAX_ROWS
from tests.benchmarks.hf import dense_transformers, packed_gguf_transformers
from tests.benchmarks.report import (
    DEFAULT_REPORT,
    cpu_section,
    machine_line,
    median_time,
    table,
    write_section,
)
from workers.engine.calibration import forward_times
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.kv_cache import PagedKVCache
from workers.model.loader import Checkpoint, build_model, load_checkpoint
from workers.model.transformer import TransformerLM

PROMPT = (
    "<|im_start|>user\nExplain in a few paragraphs why the sky is blue, and why sunsets are "
    "red.<|im_end|>\n<|im_start|>assistant\n"
)
CONTEXT = 200
NEW_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32)
PREFILL_LENGTHS = (101, 250, 257, 416, 421, 445, 511, 1000)
BLOCK_SIZE = 16
T = TypeVar("T")
TORCH_ONLY = "Outrider `SequentialEngine`, torch's kernels only"


def decode_speed(checkpoint: Checkpoint, runs: int, new_tokens: int) -> str:
    ours = build_model(checkpoint, dtype=torch.bfloat16)
    engine = SequentialEngine(
        ours, eos_token_ids=checkpoint.tokenizer.eos_token_ids, max_model_len=1024
    )
    # From the GGUF, transformers 5 keeps weights packed and dequantizes inside each matmul;
    # from an HF folder it runs the usual dense model. Both are shown.
    baselines = {
        "transformers `generate`, dense HF folder": dense_transformers(checkpoint, torch.bfloat16),
        "transformers `generate`, GGUF (packed weights)": packed_gguf_transformers(torch.bfloat16),
    }
    ids = checkpoint.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)

    def run_theirs(model: torch.nn.Module) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        return time.perf_counter() - start

    our_times: list[float] = []
    their_times: dict[str, list[float]] = {name: [] for name in baselines}
    if native.available():
        their_times[TORCH_ONLY] = []
    for run in range(runs + 1):  # run 0 warms everything up and is dropped
        our_s = engine.generate(ids, params).elapsed_s
        if TORCH_ONLY in their_times:
            with native.disabled():
                torch_only_s = engine.generate(ids, params).elapsed_s
            if run:
                their_times[TORCH_ONLY].append(torch_only_s)
        for name, model in baselines.items():
            their_s = run_theirs(model)
            if run:
                their_times[name].append(their_s)
        if run:
            our_times.append(our_s)
    rows = [
        ["Outrider `SequentialEngine`", f"{new_tokens / statistics.median(our_times):.1f}", "1.00x"]
    ]
    for name, times in their_times.items():
        ratios = [t / o for t, o in zip(times, our_times, strict=True)]
        rows.append(
            [
                name,
                f"{new_tokens / statistics.median(times):.1f}",
                f"{statistics.median(ratios):.2f}x",
            ]
        )
    return (
        f"Greedy decode of {new_tokens} tokens after a {len(ids)}-token chat prompt, bf16, "
        f"{runs} interleaved runs (tokens/s includes the prompt's prefill). The last column is "
        "how many times faster Outrider is (median of per-run ratios).\n\n"
        + table(["engine", "tokens/s (median)", "Outrider speed-up"], rows)
    )


def forward_cost_section(checkpoint: Checkpoint, reps: int) -> str:
    rows = []
    bf16 = build_model(checkpoint, dtype=torch.bfloat16)
    fp32 = build_model(checkpoint, dtype=torch.float32)
    runs = {
        "bfloat16": lambda: forward_times(bf16, NEW_TOKEN_COUNTS, reps, CONTEXT),
        "bfloat16, torch's kernels only": lambda: _torch_only(
            lambda: forward_times(bf16, NEW_TOKEN_COUNTS, reps, CONTEXT)
        ),
        "float32": lambda: forward_times(fp32, NEW_TOKEN_COUNTS, reps, CONTEXT),
        "float32, torch's kernels only": lambda: _torch_only(
            lambda: forward_times(fp32, NEW_TOKEN_COUNTS, reps, CONTEXT)
        ),
    }
    base = None
    for name, measure in runs.items():
        times = measure()
        base = base or times[0]
        for n, t in zip(NEW_TOKEN_COUNTS, times, strict=True):
            rows.append([name, n, f"{t * 1e3:.1f}", f"{t / times[0]:.2f}x", f"{t / base:.2f}x"])
    native_note = (
        f"bf16 runs our kernels (kernels/native.py, {native.variant()} build: projections, "
        "RMSNorm, attention) where they pay, fp32 our fp32 projections and attention (for "
        "rows that do not depend on their batch); the blocks marked so are the same models "
        "on torch's kernels alone."
        if native.available()
        else f"Our native kernels were unavailable here ({native.unavailable_reason()})."
    )
    return (
        f"One forward bringing n new tokens (all scored) onto a {CONTEXT}-token paged cache, "
        f"median of {reps}. Verifying k draft tokens is one forward over k + 1. {native_note}\n\n"
        + table(["dtype", "new tokens", "ms", "vs 1 token", "vs bf16, 1 token"], rows)
    )


def _torch_only(measure: Callable[[], T]) -> T:
    with native.disabled():
        return measure()


def gemv_section(model: TransformerLM, reps: int) -> str:
    """Projections over the model's real bf16 MLP weights (out of cache), 1 to 16 rows."""
    weights = [
        p
        for layer in model.layers
        for p in (layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
    ]
    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "`F.linear`": lambda x, w: F.linear(x, w),
        "`torch.mv` (1 row)": lambda x, w: torch.mv(w, x[0]),
        "`W @ x^T` (few rows)": lambda x, w: torch.mm(w, x.T),
    }
    if native.available():
        kernels[f"ours, {native.variant()} build"] = native.linear_bf16
        packed = {id(w): native.pack_bf16(w) for w in weights}
        kernels["ours, AVX512 (packed weight)"] = lambda x, w: native.linear_packed(
            x, packed[id(w)], w.shape[0]
        )
    if native.amx_available():
        kernels["ours, AMX tiles (packed weight)"] = lambda x, w: native.linear_amx(
            x, packed[id(w)], w.shape[0]
        )
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows = []
    for num_rows in (1, 4, 8, 16, 32):
        xs = {w.shape[1]: torch.randn(num_rows, w.shape[1]).to(torch.bfloat16) for w in weights}
        for name, kernel in kernels.items():
            if num_rows > 1 and "mv" in name:
                continue

            def run(kernel=kernel, xs=xs) -> None:  # type: ignore[no-untyped-def]
                for w in weights:
                    kernel(xs[w.shape[1]], w)

            t = median_time(run, reps)
            rows.append([num_rows, name, f"{t * 1e3:.1f}", f"{nbytes / t / 1e9:.1f}"])
    return (
        "The MLP weights of all 30 layers (bf16), our kernels in kernels/native.py: why "
        "`kernels/linear.py` packs the weights at load and sends the rows of a packed weight "
        f"to the AMX kernel where the CPU has AMX (up to {AMX_MAX_ROWS}; any row count up to "
        "16 costs the same), else to the packed AVX512 one (each weight it loads serves up to "
        "8 rows), whatever their number; the unpacked AVX512 kernel (its dot products grow "
        f"dearer with every row) takes up to {NATIVE_MAX_ROWS} rows of an unpacked weight "
        "with AVX512-BF16, all of them without (where torch emulates bf16 too), else one row "
        "goes to `torch.mv` and a few to `W @ x^T`.\n\n"
        + table(["rows", "kernel", "ms for all layers", "GB/s of weights"], rows)
    )


def prefill_section(model: TransformerLM, reps: int, lengths: tuple[int, ...]) -> str:
    """One forward over a whole prompt of n tokens, attention over the exact key length vs over
    the whole gathered blocks (keys past the end masked), and the latter on torch's kernels
    alone, interleaved rep by rep."""
    num_blocks = -(-max(lengths) // BLOCK_SIZE)
    runner = ModelRunner(model, PagedKVCache(model.config, num_blocks, BLOCK_SIZE, model.dtype))
    backends = {
        "exact": SdpaAttention(whole_blocks=False),
        "whole": SdpaAttention(),
        "torch only": SdpaAttention(),
    }
    vocab = model.config.vocab_size
    rows = []
    for n in lengths:
        seq = SeqForward([(i * 7919) % vocab for i in range(n)], 0, range(-(-n // BLOCK_SIZE)))
        samples: dict[str, list[float]] = {name: [] for name in backends}
        for _ in range(reps + 1):
            for name, backend in backends.items():
                model.attention = backend
                with native.disabled() if name == "torch only" else contextlib.nullcontext():
                    start = time.perf_counter()
                    runner.forward([seq])
                    samples[name].append(time.perf_counter() - start)
        exact, whole, torch_only = (statistics.median(samples[name][1:]) for name in backends)
        rows.append(
            [
                n,
                f"{exact * 1e3:.0f}",
                f"{whole * 1e3:.0f}",
                f"{exact / whole:.2f}x",
                f"{torch_only * 1e3:.0f}",
            ]
        )
    model.attention = SdpaAttention()
    return (
        f"A prompt's prefill in one forward (bf16, blocks of {BLOCK_SIZE}), median of {reps}. "
        "torch's CPU attention kernel is slow on key lengths that are not a multiple of 16, so "
        "`SdpaAttention` attends over the whole gathered blocks and masks the keys past the "
        "prompt's end (the same answer: tests/unit/test_attention.py). The last column is the "
        "whole-block forward on torch's kernels alone (no native projection or RMSNorm "
        f"kernels; the AMX one takes chunks of up to {AMX_MAX_ROWS} tokens, the packed AVX512 "
        "one any chunk).\n\n"
        + table(
            [
                "prompt tokens",
                "exact keys, ms",
                "whole blocks, ms",
                "speed-up",
                "whole blocks, torch's kernels only, ms",
            ],
            rows,
        )
    )


def _multinomial_draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """How the engine drew a token before `kernels.sampling.draw`."""
    return int(torch.multinomial(weights, 1, generator=generator))


def _multinomial_draw_rows(
    weights: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> list[int]:
    return [_multinomial_draw(w, g) for w, g in zip(weights, generators, strict=True)]


@contextlib.contextmanager
def _multinomial_draws() -> Iterator[None]:
    """Every draw the engines make through `torch.multinomial` (`draw` is `draw_rows`' one-row
    case, so this covers both)."""
    with (
        mock.patch.object(kernels.sampling, "draw_rows", _multinomial_draw_rows),
        mock.patch.object(kernels.rejection, "draw_rows", _multinomial_draw_rows),
    ):
        yield


def sampling_section(checkpoint: Checkpoint, runs: int, new_tokens: int, reps: int) -> str:
    model = build_model(checkpoint, dtype=torch.bfloat16)
    ids = checkpoint.tokenizer.encode(PROMPT)
    cache = PagedKVCache(model.config, -(-len(ids) // BLOCK_SIZE) + 1, BLOCK_SIZE, model.dtype)
    logits = ModelRunner(model, cache).forward([SeqForward(ids, 0, range(cache.num_blocks))])
    probs = torch.softmax(logits.output.logits[-1].float() / 0.8, dim=-1)
    gen = torch.Generator().manual_seed(0)
    draws = {
        "`torch.multinomial`": lambda: _multinomial_draw(probs, gen),
        "`kernels.sampling.draw` (inverse CDF, fp64)": lambda: kernels.sampling.draw(probs, gen),
    }
    micro = [[name, f"{median_time(fn, max(reps, 100)) * 1e6:.0f}"] for name, fn in draws.items()]

    engine = SequentialEngine(
        model, eos_token_ids=checkpoint.tokenizer.eos_token_ids, max_model_len=1024
    )
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=0, ignore_eos=True)
    kinds = ["greedy", "temperature 0.8, `draw`", "temperature 0.8, `torch.multinomial`"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for run in range(runs + 1):  # run 0 warms up and is dropped
        measured = {
            kinds[0]: engine.generate(ids, greedy).elapsed_s,
            kinds[1]: engine.generate(ids, sampled).elapsed_s,
        }
        with _multinomial_draws():
            measured[kinds[2]] = engine.generate(ids, sampled).elapsed_s
        if run:
            for kind, seconds in measured.items():
                times[kind].append(seconds)
    rows = [
        [
            kind,
            f"{new_tokens / statistics.median(t):.1f}",
            f"{statistics.median(g / x for g, x in zip(times[kinds[0]], t, strict=True)):.2f}x",
        ]
        for kind, t in times.items()
    ]
    return (
        f"One draw from the model's {probs.shape[0]:,}-token distribution after the prompt "
        f"(temperature 0.8), median of {max(reps, 100)}:\n\n"
        + table(["draw", "microseconds"], micro)
        + f"\n\n`SequentialEngine`, bf16, {new_tokens} tokens after the same prompt, {runs} "
        "interleaved runs; `vs greedy` is the median of per-run ratios. Sampling is host work "
        "(docs/design.md, Devices): the logits come to the CPU, the transform and the draw "
        "run there.\n\n" + table(["decode", "tokens/s (median)", "vs greedy"], rows)
    )


def options_section(checkpoint: Checkpoint, runs: int, new_tokens: int) -> str:
    model = build_model(checkpoint, dtype=torch.bfloat16)
    ids = checkpoint.tokenizer.encode(PROMPT)
    engine = LLMEngine(
        model, EngineConfig(max_model_len=1024), eos_token_ids=checkpoint.tokenizer.eos_token_ids
    )
    plain = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    kinds = {
        "greedy": plain,
        "`logprobs` 5": replace(plain, logprobs=5),
        "penalties (repetition 1.1, frequency 0.5, presence 0.5)": replace(
            plain, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5
        ),
        "temperature 0.8, penalties and `logprobs` 5": replace(
            plain,
            temperature=0.8,
            seed=0,
            logprobs=5,
            repetition_penalty=1.1,
            frequency_penalty=0.5,
            presence_penalty=0.5,
        ),
    }
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for run in range(runs + 1):  # run 0 warms up and is dropped
        for kind, params in kinds.items():
            start = time.perf_counter()
            engine.generate([ids], params)
            if run:
                times[kind].append(time.perf_counter() - start)
    base = times["greedy"]
    rows = [
        [
            kind,
            f"{new_tokens / statistics.median(t):.1f}",
            f"{statistics.median(g / x for g, x in zip(base, t, strict=True)):.2f}x",
        ]
        for kind, t in times.items()
    ]
    return (
        f"`LLMEngine` (the verifier's engine), bf16, no speculation, {new_tokens} tokens after the "
        f"same prompt, {runs} interleaved runs; `vs greedy` is the median of per-run ratios. "
        "Log-probabilities are a log-softmax and a top-k of each committed token's logits row; "
        "penalties count the output's tokens (and each draft's predecessors) over the vocabulary "
        "per step; both run on the host.\n\n"
        + table(["request", "tokens/s (median)", "vs greedy"], rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="interleaved decode runs per engine")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30, help="repetitions per forward timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.new_tokens, args.reps = 1, 8, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    checkpoint = load_checkpoint()
    section, on_this_cpu = cpu_section("bench_forward")
    title = "Plain decode and forward cost" + on_this_cpu
    with torch.inference_mode():
        parts = [
            f"## {title} (`python -m tests.benchmarks.bench_forward`)",
            f"Machine: {machine_line()}. Model: bundled SmolLM2-135M-Instruct "
            "(Q4_1 GGUF, dequantized).",
            "### Decode speed vs transformers",
            decode_speed(checkpoint, args.runs, args.new_tokens),
            "### Forward cost by number of new tokens",
            forward_cost_section(checkpoint, args.reps),
            "### Projection kernels for few rows",
            gemv_section(build_model(checkpoint, dtype=torch.bfloat16), args.reps),
            "### Prefill attention over whole KV blocks",
            prefill_section(
                build_model(checkpoint, dtype=torch.bfloat16),
                max(3, args.reps // 3),
                PREFILL_LENGTHS[:2] if args.quick else PREFILL_LENGTHS,
            ),
            "### Drawing a sampled token",
            sampling_section(checkpoint, args.runs, args.new_tokens, args.reps),
            "### Log-probabilities and penalties",
            options_section(checkpoint, args.runs, args.new_tokens),
        ]
    body = "\n\n".join(parts)
    print(body)
    write_section(section, body, args.output)
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
