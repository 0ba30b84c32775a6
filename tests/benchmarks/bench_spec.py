"""Speculative decoding on the bundled model, beside plain decoding and transformers.

    python -m tests.benchmarks.bench_spec            # full run (~10 min), writes docs/benchmarks.md
    python -m tests.benchmarks.bench_spec --quick    # a smoke run

For three kinds of prompt (code edits that return the code, a summary that quotes its passage,
an open chat question), greedy, bf16:
  1. single stream: tokens/s and mean acceptance length of none / ngram / suffix / draft_model,
     with the ideal speed-up that the measured acceptance and verify cost allow;
  2. 4 and 16 concurrent requests: total tokens/s per method;
  3. the same prompts through transformers' `generate`, its prompt lookup
     (`prompt_lookup_num_tokens`) and assisted generation (`assistant_model`).
All runs of a table are interleaved, and medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import native
from kernels.linear import row_independent_rows
from tests.benchmarks.hf import dense_transformers
from tests.benchmarks.report import (
    DEFAULT_REPORT,
    cpu_section,
    machine_line,
    table,
    write_section,
)
from tests.benchmarks.spec_prompts import chat_prompts
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.engine.calibration import forward_times, relative_token_cost
from workers.engine.config import (
    EngineConfig,
    RequestSpec,
    SpecConfig,
)
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import Checkpoint, build_model, load_checkpoint, truncate_layers
from workers.model.transformer import TransformerLM

METHODS = ("none", "ngram", "suffix", "draft_model")
STAT_COLUMNS = [
    "prompt",
    "method",
    "tokens/s",
    "vs none",
    "mean acceptance length",
    "drafts/step",
    "α",
]
K = 16  # the most draft tokens per step; adaptive k picks fewer where acceptance is low
# transformers' prompt lookup drafts a fixed number of tokens; it runs with each of these and
# Outrider is compared with the faster.
HF_LOOKUP_TOKENS = (8, 16)
DRAFT_LAYERS = 12
# The most tokens a step verifies: speculation stops at `disable_batch_size` unfinished requests.
MAX_VERIFY_ROWS = (SpecConfig().disable_batch_size - 1) * (K + 1)


@dataclass(slots=True)
class Run:
    seconds: float
    completions: list[Completion]

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def build_engine(
    target: TransformerLM,
    draft: TransformerLM,
    checkpoint: Checkpoint,
    adaptive: bool = True,
    k: int = K,
    min_confidence: float = 0.0,
) -> LLMEngine:
    """`min_confidence`: the draft model's draft ends where its probability falls below it."""
    spec = SpecConfig(method="none", num_speculative_tokens=k, adaptive=adaptive)
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024, spec=spec
    )
    ngram = NgramConfig()  # the defaults `outrider serve` uses
    drafters = {
        "ngram": NgramDrafter(ngram),
        "suffix": SuffixDrafter(ngram),
        "draft_model": DraftModelDrafter(
            draft, num_blocks=config.kv_blocks, max_model_len=1024, min_confidence=min_confidence
        ),
    }
    return LLMEngine(
        target,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.tokenizer.eos_token_ids,
        drafters=drafters,
        draft_costs={"draft_model": relative_token_cost(draft, target)},
    )


def run(engine: LLMEngine, prompts: Sequence[list[int]], method: str, max_tokens: int) -> Run:
    """The prompts together (concurrent requests)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec = RequestSpec(enabled=method != "none", method=None if method == "none" else method)
    start = time.perf_counter()
    completions = engine.generate(prompts, params, spec)
    return Run(time.perf_counter() - start, completions)


def run_each(engine: LLMEngine, prompts: Sequence[list[int]], method: str, max_tokens: int) -> Run:
    """The prompts one after another (single stream), pooled."""
    runs = [run(engine, [p], method, max_tokens) for p in prompts]
    return Run(sum(r.seconds for r in runs), [c for r in runs for c in r.completions])


def merged_stats(runs: list[Run]) -> tuple[float, float, float]:
    """(mean acceptance length, drafts per verify step, per-token acceptance) over runs."""
    accepted = drafted = steps = rejected = 0
    for r in runs:
        for c in r.completions:
            accepted += c.spec.accepted
            drafted += c.spec.drafted
            steps += c.spec.verify_steps
            rejected += c.spec.verify_steps_with_rejection
    if not steps:
        return 1.0, 0.0, 0.0
    alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0
    return (accepted + steps) / steps, drafted / steps, alpha


def interleaved(runs: int, jobs: dict[str, Callable[[], Run]], label: str) -> dict[str, list[Run]]:
    """Each job `runs` times, round-robin, after one warm-up round."""
    results: dict[str, list[Run]] = {name: [] for name in jobs}
    for round_ in range(runs + 1):
        for name, job in jobs.items():
            result = job()
            if round_:
                results[name].append(result)
        print(f"[bench_spec] {label}: round {round_}/{runs} done", file=sys.stderr, flush=True)
    return results


def run_methods(
    engine: LLMEngine,
    prompts: list[list[int]],
    runs: int,
    max_tokens: int,
    label: str,
    together: bool,
) -> dict[str, list[Run]]:
    """Every method of METHODS on the same prompts (all at once, or one at a time), interleaved."""
    how = run if together else run_each
    jobs = {m: (lambda m=m: how(engine, prompts, m, max_tokens)) for m in METHODS}
    return interleaved(runs, jobs, label)


def median_tps(runs: list[Run]) -> float:
    return statistics.median(r.tokens_per_s for r in runs)


def paired_ratio(runs: list[Run], base: list[Run]) -> float:
    """Median over rounds of tokens/s against `base`'s in the same round. The jobs of a round
    run one right after another, so a machine that slows down for a while slows both sides of a
    ratio alike (a ratio of medians would set one round's slow run against another's fast one)."""
    return statistics.median(
        r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, base, strict=True)
    )


def single_stream(
    engine: LLMEngine,
    prompt_ids: dict[str, list[list[int]]],
    runs: int,
    max_tokens: int,
    verify_cost: list[float],
    draft_cost: float,
) -> tuple[str, dict[tuple[str, str], float]]:
    rows, speedups = [], {}
    for kind, ids in prompt_ids.items():
        results = run_methods(engine, ids, runs, max_tokens, f"single stream, {kind}", False)
        for method in METHODS:
            tps = median_tps(results[method])
            speedup = paired_ratio(results[method], results["none"])
            length, k_mean, alpha = merged_stats(results[method])
            speedups[(kind, method)] = speedup
            per_draft = draft_cost if method == "draft_model" else 0.0
            bound = ideal_speedup(length, k_mean, verify_cost, per_draft)
            ideal = "" if method == "none" else f"{bound:.2f}x"
            rows.append(
                [
                    kind,
                    method,
                    f"{tps:.1f}",
                    f"{speedup:.2f}x",
                    f"{length:.2f}",
                    f"{k_mean:.2f}",
                    f"{alpha:.2f}",
                    ideal,
                ]
            )
    text = table(
        [*STAT_COLUMNS, "ideal"],
        rows,
    )
    return text, speedups


def ideal_speedup(
    length: float, k_mean: float, verify_cost: list[float], draft_cost: float
) -> float:
    """Committed tokens per step over the step's cost in one-token forwards: the speed-up if
    nothing but the target forward and drafting took time."""
    lo = int(k_mean)
    hi = min(lo + 1, len(verify_cost) - 1)
    frac = k_mean - lo
    cost = verify_cost[min(lo, len(verify_cost) - 1)] * (1 - frac) + verify_cost[hi] * frac
    return length / (cost + k_mean * draft_cost)


def concurrency(
    engine: LLMEngine,
    prompt_ids: dict[str, list[list[int]]],
    runs: int,
    max_tokens: int,
    levels: Sequence[int],
) -> tuple[str, dict[tuple[int, str], float]]:
    rows, speedups = [], {}
    kinds = list(prompt_ids.values())
    for n in levels:
        batch = []  # kinds in turn; within a kind, its prompts in turn
        for i in range(n):
            same_kind = kinds[i % len(kinds)]
            batch.append(same_kind[i // len(kinds) % len(same_kind)])
        results = run_methods(engine, batch, runs, max_tokens, f"{n} concurrent", True)
        base_steps = last_request_steps(results["none"])
        for method in METHODS:
            tps = median_tps(results[method])
            speedup = paired_ratio(results[method], results["none"])
            length, k_mean, _ = merged_stats(results[method])
            speedups[(n, method)] = speedup
            bound = base_steps / last_request_steps(results[method])
            rows.append(
                [
                    n,
                    method,
                    f"{tps:.1f}",
                    f"{speedup:.2f}x",
                    f"{length:.2f}",
                    f"{k_mean:.2f}",
                    f"{bound:.2f}x",
                ]
            )
    text = table(
        [
            "concurrent requests",
            "method",
            "total tokens/s",
            "vs none",
            "mean acceptance length",
            "drafts/step",
            "last request bound",
        ],
        rows,
    )
    return text, speedups


def last_request_steps(runs: list[Run]) -> float:
    """Median over runs of the most steps any one request took (its first token included)."""
    return statistics.median(max(c.spec.verify_steps + 1 for c in r.completions) for r in runs)


def transformers_section(
    checkpoint: Checkpoint,
    engine: LLMEngine,
    prompt_ids: dict[str, list[list[int]]],
    runs: int,
    max_tokens: int,
) -> tuple[str, dict[str, float]]:
    hf = dense_transformers(checkpoint, torch.bfloat16)
    hf_draft = dense_transformers(truncate_layers(checkpoint, DRAFT_LAYERS), torch.bfloat16)

    def hf_job(prompts: list[list[int]], **kwargs: object) -> Callable[[], Run]:
        def job() -> Run:  # one prompt after another, pooled (as `run_each`)
            seconds, completions = 0.0, []
            for ids in prompts:
                start = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(
                        torch.tensor([ids]),
                        max_new_tokens=max_tokens,
                        do_sample=False,
                        pad_token_id=2,
                        **kwargs,
                    )
                seconds += time.perf_counter() - start
                completions.append(Completion("hf", ids, out[0, len(ids) :].tolist()))
            return Run(seconds, completions)

        return job

    rows, ratios = [], {}
    for kind, ids in prompt_ids.items():
        jobs = {
            "Outrider ngram": lambda ids=ids: run_each(engine, ids, "ngram", max_tokens),
            "Outrider none": lambda ids=ids: run_each(engine, ids, "none", max_tokens),
            "transformers plain": hf_job(ids),
        }
        for n in HF_LOOKUP_TOKENS:
            jobs[f"transformers prompt lookup, {n} tokens"] = hf_job(
                ids, prompt_lookup_num_tokens=n
            )
        jobs["transformers assisted (12-layer draft)"] = hf_job(ids, assistant_model=hf_draft)
        results = interleaved(runs, jobs, f"transformers, {kind}")
        lookup = max(
            (results[f"transformers prompt lookup, {n} tokens"] for n in HF_LOOKUP_TOKENS),
            key=median_tps,
        )
        ratios[kind] = paired_ratio(results["Outrider ngram"], lookup)
        for name, rs in results.items():
            ratio = paired_ratio(rs, lookup)
            rows.append([kind, name, f"{median_tps(rs):.1f}", f"{ratio:.2f}x"])
    header = ["prompt", "engine", "tokens/s", "vs transformers' faster prompt lookup"]
    return table(header, rows), ratios


def main() -> None:
    from tests.benchmarks.bench_spec_qwen import qwen_pair_section

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    parser.add_argument(
        "--pair",
        choices=["qwen"],
        help="instead: the Qwen2.5-Coder draft/target pair (make models-qwen)",
    )
    args = parser.parse_args()
    if args.pair:
        torch.set_num_threads(args.threads)
        with torch.inference_mode():
            body = "## Speculative decoding: a real draft/target pair\n\n" + (
                "`python -m tests.benchmarks.bench_spec --pair qwen`\n\n"
                f"Machine: {machine_line()}. Greedy, up to {args.max_tokens} new tokens, "
                f"medians of {args.runs} interleaved runs (a speed-up: of the ratios within a "
                "run).\n\n" + qwen_pair_section(args.runs, args.max_tokens)
            )
        print(body)
        write_section("bench_spec_qwen", body, args.output)
        return
    levels = (4, 16)
    if args.quick:
        args.runs, args.max_tokens, levels = 1, 8, (4,)
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint()
    target = build_model(checkpoint, dtype=torch.bfloat16)
    draft = build_model(truncate_layers(checkpoint, DRAFT_LAYERS), dtype=torch.bfloat16)
    engine = build_engine(target, draft, checkpoint)
    prompt_ids = chat_prompts(checkpoint.tokenizer)
    with torch.inference_mode():
        verify_cost_s = forward_times(target, range(1, K + 2), reps=3 if args.quick else 20)
        draft_cost = forward_times(draft, [1], reps=3 if args.quick else 20)[0] / verify_cost_s[0]
        verify_cost = [t / verify_cost_s[0] for t in verify_cost_s]
        single, single_x = single_stream(
            engine, prompt_ids, args.runs, args.max_tokens, verify_cost, draft_cost
        )
        multi, multi_x = concurrency(engine, prompt_ids, args.runs, args.max_tokens, levels)
        hf_table, hf_x = transformers_section(
            checkpoint, engine, prompt_ids, args.runs, args.max_tokens
        )
    goals = [
        ["n-gram on code edit vs none", ">= 2.5x", f"{single_x[('code edit', 'ngram')]:.2f}x"],
        [
            "worst method on open chat vs none",
            ">= 0.95x",
            f"{min(single_x[('open chat', m)] for m in METHODS):.2f}x",
        ],
        [
            f"worst method at {max(levels)} concurrent vs none",
            ">= 0.95x",
            f"{min(multi_x[(max(levels), m)] for m in METHODS):.2f}x",
        ],
        [
            "Outrider n-gram vs transformers' faster prompt lookup (worst prompt)",
            ">= 2x",
            f"{min(hf_x.values()):.2f}x",
        ],
    ]
    costs = ", ".join(f"{n}: {c:.2f}" for n, c in enumerate(verify_cost, start=1))
    section, on_this_cpu = cpu_section("bench_spec")
    body = "\n\n".join(
        [
            f"## Speculative decoding{on_this_cpu}\n\n`python -m tests.benchmarks.bench_spec`",
            f"Machine: {machine_line()}. Bundled SmolLM2-135M-Instruct, bf16, greedy, chat "
            f"template, up to {args.max_tokens} new tokens, k <= {K} (adaptive), medians of "
            f"{args.runs} interleaved runs; a speed-up (`vs ...`) is the median over runs of the "
            "ratio within a run, where the methods run one right after another. draft_model is "
            f"the target's first {DRAFT_LAYERS} "
            "layers (the bundled model has no smaller sibling); adaptive k turns it off where it "
            "does not pay. "
            + (
                "On this CPU our native kernels compute each token's bf16 logits the same way "
                "however many tokens its forward scores, so every method commits the text `none` "
                "does (tests/model/test_speculative_exact.py). "
                if row_independent_rows() >= MAX_VERIFY_ROWS
                else "Greedy bf16 output depends on how many tokens a forward scores (bf16 "
                "logits tie) on torch's kernels, so a prompt's text, and with it the "
                "acceptance, can differ between methods and processes. "
            )
            + "Code edits pool three prompts (a Python typo, a rename in a script, a JavaScript "
            "bug), run one after another, as a single prompt's copy can hold or drift.",
            "### Goals",
            table(["goal", "target", "measured"], goals),
            "### Single stream",
            "`α` is the per-token acceptance rate; `ideal` is mean acceptance length divided by "
            "the measured cost of the step (verify forward of k+1 tokens, plus drafting) in "
            f"one-token forwards. Verify cost by tokens in the forward: {costs}; a draft-model "
            f"token costs {draft_cost:.2f}.",
            single,
            "### Concurrent requests",
            "Requests cycle over the three kinds (and within a kind over its prompts) and start "
            "together, and the run ends when the last one finishes, so that request's own "
            "speed-up weighs most: `last request bound` is the most steps any request took "
            "without speculation over the most with the method (steps get cheaper as the batch "
            "thins out, so tokens/s can beat it a little; a server that refills finished slots "
            "is not held back this way). Adaptive k weighs each "
            "sequence's drafts against the whole batch's forward; speculation switches off from "
            "8 unfinished requests (`disable_batch_size`).",
            multi,
            "### Against transformers",
            "transformers runs the same dense bf16 weights (`generate`, "
            f"`prompt_lookup_num_tokens` = {' and '.join(map(str, HF_LOOKUP_TOKENS))}, and "
            f"`assistant_model` = the same {DRAFT_LAYERS}-layer draft). Outrider runs our "
            f"native CPU kernels (kernels/native.py, {native.variant()} build: projections, "
            "RMSNorm, attention); transformers runs torch's kernels.",
            hf_table,
        ]
    )
    print(body)
    write_section(section, body, args.output)
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
