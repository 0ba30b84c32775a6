"""Quantized weights on the CPU, beside llama.cpp on the same GGUF file and threads.

    python -m tests.benchmarks.bench_quant              # bundled model (~5 min), writes docs
    python -m tests.benchmarks.bench_quant --pair qwen  # Qwen2.5-Coder 1.5B with its 0.5B drafter
    python -m tests.benchmarks.bench_quant --quick      # a smoke run (llama.cpp where installed)

llama.cpp runs through llama-cpp-python (installed here with pip where missing: it builds
llama.cpp for this CPU, a few minutes). Both engines get the same prompt tokens (the chat
template applied by Outrider's tokenizer) and decode greedily, each prompt for as many tokens as
Outrider's answer to it takes (up to `--max-tokens`; llama.cpp's own answer, from other
arithmetic, may end elsewhere, so it makes exactly that many): the same work on both sides, and
tokens/s is those tokens over the time from the prompt to the last one, prefill included. The
prompts are bench_spec's: code edits that return the code, a summary that quotes its passage, an
open chat question. All jobs of a table are interleaved, and a ratio is the median of the
ratios within a round.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from tests.benchmarks.bench_spec import (
    Run,
    interleaved,
    median_tps,
    merged_stats,
    paired_ratio,
)
from tests.benchmarks.report import (
    bench_args,
    bench_parser,
    cpu_section,
    machine_line,
    table,
    write_section,
)
from tests.benchmarks.spec_prompts import chat_prompts
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import LoadedEngine, ModelSpec, build_engine
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import resolve_model_path

LLAMA_CPP = "llama-cpp-python==0.3.36"
K = 16  # the most draft tokens per step (adaptive k picks fewer)
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")  # target, drafter (make models-qwen)


def llama_cpp_module(install: bool) -> Any:
    """llama_cpp, installed into this environment first where missing (and `install`)."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        if not install:
            return None
    print(f"[bench_quant] installing {LLAMA_CPP} (builds llama.cpp)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", LLAMA_CPP], check=True)
    importlib.invalidate_caches()
    return importlib.import_module("llama_cpp")


Job = Callable[[Sequence[list[int]], Sequence[int]], Run]  # (prompts, tokens each) -> a run


class LlamaCpp:
    """llama.cpp on a GGUF file: greedy, exactly the given number of tokens per prompt."""

    def __init__(self, module: Any, path: Path, threads: int, prompt_lookup: bool = False):
        draft = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
        self.llm = module.Llama(
            model_path=str(path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=2048,
            n_batch=512,
            draft_model=draft,
            verbose=False,
        )

    def run(self, prompts: Sequence[list[int]], budgets: Sequence[int]) -> Run:
        seconds, completions = 0.0, []
        for ids, budget in zip(prompts, budgets, strict=True):
            tokens: list[int] = []
            start = time.perf_counter()
            for token in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == budget:
                    break
            seconds += time.perf_counter() - start
            completions.append(Completion("llama.cpp", list(ids), tokens))
        return Run(seconds, completions)


def outrider(model: str | None, quantization: str, draft_model: str | None = None) -> LoadedEngine:
    spec = SpecConfig(method="none", num_speculative_tokens=K)
    config = EngineConfig(max_model_len=2048, max_num_batched_tokens=1024, spec=spec)
    model_spec = ModelSpec(model, "bfloat16", draft_model, quantization=quantization)
    return build_engine(model_spec, config, progress=False)


def outrider_run(loaded: LoadedEngine, method: str) -> Job:
    """Greedy, up to the given tokens per prompt (its own answer ends there or before)."""

    def run(prompts: Sequence[list[int]], budgets: Sequence[int]) -> Run:
        spec = RequestSpec(enabled=method != "none", method=None if method == "none" else method)
        seconds, completions = 0.0, []
        for ids, budget in zip(prompts, budgets, strict=True):  # one after another
            params = SamplingParams(max_tokens=budget, temperature=0)
            start = time.perf_counter()
            completions += loaded.engine.generate([ids], params, spec)
            seconds += time.perf_counter() - start
        return Run(seconds, completions)

    return run


def llama_cpp_step_bytes(path: Path) -> int:
    """The weight bytes a llama.cpp decode step streams: every 2-D tensor as stored but the
    token embedding, which a lookup reads a few rows of (unless the LM head is tied to it)."""
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return sum(
        int(t.n_bytes)
        for t in reader.tensors
        if len(t.shape) == 2 and (t.name != "token_embd.weight" or tied)
    )


def compare(
    jobs: dict[str, Job],
    base: str,
    answers: Job,
    prompt_ids: dict[str, list[list[int]]],
    runs: int,
    max_tokens: int,
    step_mb: dict[str, float],
) -> tuple[list[list[str]], dict[tuple[str, str], float]]:
    """Rows (prompt, engine, tokens/s, vs `base`, mean acceptance length, MB a step) and the
    ratios by (prompt, engine); each prompt runs for as many tokens as `answers` gives it."""
    rows, ratios = [], {}
    for kind, ids in prompt_ids.items():
        first = answers(ids, [max_tokens] * len(ids))
        budgets = [max(1, len(c.token_ids)) for c in first.completions]
        bound = {name: (lambda job=job, i=ids, b=budgets: job(i, b)) for name, job in jobs.items()}
        results = interleaved(runs, bound, kind)
        for name, rs in results.items():
            ratio = paired_ratio(rs, results[base])
            ratios[(kind, name)] = ratio
            length = "" if name.startswith("llama.cpp") else f"{merged_stats(rs)[0]:.2f}"
            mb = step_mb.get(name)
            rows.append(
                [
                    kind,
                    name,
                    f"{median_tps(rs):.1f}",
                    f"{ratio:.2f}x",
                    length,
                    "" if mb is None else f"{mb:.0f}",
                ]
            )
    return rows, ratios


HEADER = ["prompt", "engine", "tokens/s", "vs llama.cpp plain", "mean acceptance length", "MB/step"]


def bundled_section(args: argparse.Namespace, module: Any) -> str:
    path = resolve_model_path(None)
    floats = outrider(None, "none")
    blocks = outrider(None, "gguf")
    assert blocks.engine.runner.model.quantized_kinds(), "the bundled GGUF's blocks were not kept"
    prompt_ids = chat_prompts(blocks.tokenizer)
    if args.quick:
        prompt_ids = {"code edit": prompt_ids["code edit"][:1]}
    jobs: dict[str, Job] = {}
    step_mb = {
        "Outrider plain, bf16 weights": floats.engine.runner.model.step_weight_bytes() / 1e6,
        "Outrider plain, GGUF blocks": blocks.engine.runner.model.step_weight_bytes() / 1e6,
    }
    if module is not None:
        jobs["llama.cpp plain"] = LlamaCpp(module, path, args.threads).run
        jobs["llama.cpp prompt lookup"] = LlamaCpp(module, path, args.threads, True).run
        step_mb["llama.cpp plain"] = llama_cpp_step_bytes(path) / 1e6
    jobs["Outrider plain, bf16 weights"] = outrider_run(floats, "none")
    jobs["Outrider plain, GGUF blocks"] = outrider_run(blocks, "none")
    jobs["Outrider ngram, GGUF blocks"] = outrider_run(blocks, "ngram")
    jobs["Outrider eagle, GGUF blocks"] = outrider_run(blocks, "eagle")
    base = "llama.cpp plain" if module is not None else "Outrider plain, bf16 weights"
    answers = jobs["Outrider plain, GGUF blocks"]
    with torch.inference_mode():
        rows, ratios = compare(jobs, base, answers, prompt_ids, args.runs, args.max_tokens, step_mb)
    goals = []
    if module is not None:
        plain = min(ratios[(k, "Outrider plain, GGUF blocks")] for k in prompt_ids)
        goals.append(
            ["Outrider plain vs llama.cpp plain, worst prompt", ">= 1.2x", f"{plain:.2f}x"]
        )
        for kind in ("code edit", "summary"):
            if kind in prompt_ids:
                got = ratios[(kind, "Outrider ngram, GGUF blocks")]
                goals.append([f"Outrider ngram vs llama.cpp plain, {kind}", ">= 2x", f"{got:.2f}x"])
    kinds = blocks.engine.runner.model.quantized_kinds()
    held = ", ".join(f"{n} {k.upper()}" for k, n in sorted(kinds.items()))
    text = (
        f"Machine: {machine_line()}. Bundled SmolLM2-135M-Instruct, its Q4_1 GGUF ({held} "
        "weights kept in their blocks; `bf16 weights` dequantizes them at load as "
        f"`--quantization none` does), bf16 activations, greedy, answers of up to "
        f"{args.max_tokens} tokens, medians of {args.runs} interleaved runs. llama.cpp: "
        f"{llama_cpp_version()}, {args.threads} threads (`n_threads` and `n_threads_batch`); "
        "its prompt lookup is llama-cpp-python's (`LlamaPromptLookupDecoding`, 10 tokens, "
        "drafted and verified from Python). Outrider's speculation uses adaptive k up to "
        f"{K}. MB/step: the weight bytes one decode step streams.\n\n"
    )
    if goals:
        text += "### Goals\n\n" + table(["goal", "target", "measured"], goals) + "\n\n"
    return text + "### Single stream\n\n" + table(HEADER, rows)


def pair_section(args: argparse.Namespace, module: Any) -> str:
    target, drafter = PAIR
    path = resolve_model_path(target)
    loaded = outrider(target, "auto", drafter)
    prompt_ids = chat_prompts(loaded.tokenizer)
    jobs: dict[str, Job] = {}
    step_mb = {"Outrider plain": loaded.engine.runner.model.step_weight_bytes() / 1e6}
    if module is not None:
        jobs["llama.cpp plain"] = LlamaCpp(module, path, args.threads).run
        step_mb["llama.cpp plain"] = llama_cpp_step_bytes(path) / 1e6
    jobs["Outrider plain"] = outrider_run(loaded, "none")
    jobs["Outrider draft_model (0.5B)"] = outrider_run(loaded, "draft_model")
    jobs["Outrider ngram"] = outrider_run(loaded, "ngram")
    base = "llama.cpp plain" if module is not None else "Outrider plain"
    with torch.inference_mode():
        rows, ratios = compare(
            jobs, base, jobs["Outrider plain"], prompt_ids, args.runs, args.max_tokens, step_mb
        )
    kinds = loaded.engine.runner.model.quantized_kinds()
    held = ", ".join(f"{n} {k.upper()}" for k, n in sorted(kinds.items()))
    text = (
        "`python -m tests.benchmarks.bench_quant --pair qwen`\n\n"
        f"Machine: {machine_line()}. Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF: Q4_K and Q6_K) "
        "as the target, Qwen2.5-Coder-0.5B-Instruct (Q5_0 GGUF) drafting for it, both with "
        f"`--quantization auto` (the target holds {held} weights: Q4_K as Q4_1-like blocks of "
        "32, Q6_K requantized to 8 bits), bf16 activations, greedy, "
        f"answers of up to {args.max_tokens} tokens, medians of {args.runs} interleaved runs; "
        f"llama.cpp {llama_cpp_version()} plain on the 1.5B file, {args.threads} threads.\n\n"
    )
    if module is not None:
        best = statistics.median(ratios[(k, "Outrider draft_model (0.5B)")] for k in prompt_ids)
        worst = min(ratios[(k, "Outrider draft_model (0.5B)")] for k in prompt_ids)
        text += (
            "### Goals\n\n"
            + table(
                ["goal", "target", "measured"],
                [
                    [
                        "1.5B with its 0.5B drafter vs llama.cpp plain 1.5B, median prompt",
                        ">= 1.5x",
                        f"{best:.2f}x",
                    ],
                    ["the same, worst prompt", "", f"{worst:.2f}x"],
                ],
            )
            + "\n\n"
        )
    return text + "### Single stream\n\n" + table(HEADER, rows)


def llama_cpp_version() -> str:
    try:
        return "llama-cpp-python " + importlib.import_module("llama_cpp").__version__
    except ImportError:
        return "not installed"


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--pair", choices=["qwen"], help="the Qwen2.5-Coder pair instead")
    args = bench_args(parser)
    module = llama_cpp_module(install=not args.quick)
    if args.pair:
        body = "## Quantized weights: a real draft/target pair\n\n" + pair_section(args, module)
        print(body)
        write_section("bench_quant_qwen", body, args.output)
        return
    name, suffix = cpu_section("bench_quant")
    body = (
        f"## Quantized weights on the CPU vs llama.cpp{suffix}\n\n"
        "`python -m tests.benchmarks.bench_quant`\n\n" + bundled_section(args, module)
    )
    print(body)
    write_section(name, body, args.output)


if __name__ == "__main__":
    main()
