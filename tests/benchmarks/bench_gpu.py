"""The GPU benchmark: Outrider's engine on one CUDA GPU beside transformers on the same card.

    python -m tests.benchmarks.bench_gpu --out DIR       # on the GPU machine (bundled model)
    python -m tests.benchmarks.bench_gpu --render DIR/gpu.json   # anywhere: docs/benchmarks.md

One process, one card, in this order (each part writes DIR/gpu.json as it ends, so a run cut
short keeps what it measured; a part that raises is recorded and the next one runs):
1. the card, torch's version, and its measured device-to-device copy bandwidth;
2. forward cost by new tokens of one sequence (1..16 through the captured graphs; 64 and 256
   eager), beside the eager runner, bundled model in bf16;
3. single stream (greedy, 128 tokens) for no speculation, ngram and eagle on code edits, a
   summary and open chat (bench_spec's prompts), adaptive k as served;
4. 1, 16, 64 and 256 concurrent requests (held-out prompts) for each method;
5. `--deterministic` (batch-invariant kernels) beside the default kernels: single stream,
   16 and 64 concurrent, and how many greedy texts change alone vs together
   (tests/benchmarks/bench_gpu_deterministic.py);
6. a model of Llama-3.1-8B's shape with random bf16 weights made on the device: forward costs
   and plain decode at batch 1 and 64 against their floor (weight and KV bytes a step reads
   over the measured copy bandwidth);
7. transformers on the same weights: `generate` eager, with `cache_implementation="static"`
   (which compiles the forward and replays CUDA graphs), eager with prompt lookup, and the
   static cache at batch 64.

Our engine runs without a tokenizer here (token ids only, as `generate`); the served path also
detokenizes. Free of Ray, Redis and OpenTelemetry imports: the lent GPU machines have none.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from workers.drafting.eagle import EagleDrafter
from workers.eagle.prompts import held_out_prompts
from workers.engine.calibration import runner_samples
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_drafters
from workers.engine.graph_runner import GraphRunner
from workers.engine.heap import freeze_startup_heap
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import StepReport
from workers.engine.sampling_params import SamplingParams
from workers.kv_cache import PagedKVCache
from workers.model.loader import Checkpoint, build_model, load_checkpoint
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

METHODS = ("none", "ngram", "eagle")
LEVELS = (1, 16, 64, 256)
FORWARD_COUNTS = (*range(1, 17), 64, 256)
CONTEXT = 256  # cached tokens under the forward-cost rows
K = 4  # draft tokens at most, as served
# Tokens a step may bring (EngineConfig.max_num_batched_tokens, 512 by default for CPUs): prefill
# chunks run eagerly, and an eager forward of the bundled model costs about the same for 16 or
# 256 tokens on a GPU, so fewer, larger prefill steps pay.
PREFILL_BUDGET = 2048


def chat_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- parts ------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {
            "card": "cpu (a dry run)",
            "torch": torch.__version__,
            "copy_gb_s": 10.0,
            "date": time.strftime("%Y-%m-%d"),
        }
    import triton

    size = 2**30  # bytes per buffer
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / 10
    props = torch.cuda.get_device_properties(device)
    return {
        "card": props.name,
        "memory_gib": round(props.total_memory / 2**30),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gb_s": 2 * size / seconds / 1e9,  # bytes read plus written
        "date": time.strftime("%Y-%m-%d"),
    }


def forward_costs(model: TransformerLM, counts: Sequence[int], reps: int) -> dict[str, Any]:
    """ms of one forward of n new tokens onto a CONTEXT-token cache, graphs and eager."""
    block_size = 16
    num_blocks = -(-(CONTEXT + max(counts)) // block_size)
    cache = PagedKVCache(model.config, num_blocks + 1, block_size, model.dtype, model.device)
    width = max(n for n in counts if n <= 17)
    graphs = GraphRunner(
        model,
        cache,
        attention=_uniform_backend(model, width),
        max_num_seqs=1,
        max_width=width,
        max_graph_tokens=width,
        scratch_block=num_blocks,
    )
    capture_s = graphs.capture(progress=False).seconds if model.device.type == "cuda" else 0.0
    eager = ModelRunner(model, cache)
    blocks = list(range(num_blocks))
    rows = {}
    for name, runner in (("graph", graphs), ("eager", eager)):
        samples = runner_samples(runner, blocks, counts, reps, CONTEXT)
        rows[name] = [1000 * statistics.median(s) for s in samples]
    return {
        "counts": list(counts),
        "graph_ms": rows["graph"],
        "eager_ms": rows["eager"],
        "capture_s": capture_s,
        "attention": graphs.attention.name,
    }


def _uniform_backend(model: TransformerLM, max_width: int) -> Any:
    from kernels.attention_uniform import select_uniform_backend

    shape = model.config
    group = shape.num_heads // shape.num_kv_heads
    return select_uniform_backend(model.device, model.dtype, shape.head_dim, group, max_width)


def bundled_engine(
    checkpoint: Checkpoint,
    model: TransformerLM,
    max_num_seqs: int,
    spec: SpecConfig | None = None,
    async_scheduling: bool = False,
) -> tuple[LLMEngine, float]:
    """One engine serving every method (per request), graphs captured; its start-up seconds.
    `spec` (default: at most K drafts, adaptive): `adaptive=False` drafts k tokens every step
    (what the head accepts when it drafts); `tree_nodes`: EAGLE drafts trees of up to that many
    nodes where they pay."""
    config = EngineConfig(
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=PREFILL_BUDGET,
        async_scheduling=async_scheduling,
        spec=spec or SpecConfig(num_speculative_tokens=K),
    )
    # The drafters a server builds for these settings, by the code it builds them with (the
    # factory): EAGLE with its served confidence bar, prompt lookup, loops and their graphs,
    # its measured token and tree prices.
    served = ModelSpec(dtype="bfloat16", device=str(model.device))
    start = time.perf_counter()
    drafters, seconds = build_drafters(
        served, config, checkpoint.config, checkpoint, model, progress=False
    )
    engine = LLMEngine(
        model,
        config,
        eos_token_ids=checkpoint.tokenizer.eos_token_ids,
        drafters=drafters,
        draft_seconds=seconds,
    )
    return engine, time.perf_counter() - start


def spec_for(method: str) -> RequestSpec:
    return RequestSpec(enabled=False) if method == "none" else RequestSpec(method=method)


def timed_generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    method: str,
    max_tokens: int,
    ignore_eos: bool = False,
) -> tuple[int, float, float]:
    """(output tokens, seconds, mean acceptance length) of the prompts served together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    sync()
    start = time.perf_counter()
    done = engine.generate(prompts, params, spec_for(method))
    sync()
    seconds = time.perf_counter() - start
    steps = sum(c.spec.verify_steps for c in done)
    accepted = sum(c.spec.accepted for c in done)
    return sum(len(c.token_ids) for c in done), seconds, (accepted + steps) / max(steps, 1)


def draft_replays(engine: LLMEngine) -> int:
    """Proposals the EAGLE drafter's draft loops (chains, trees) served from graphs so far."""
    eagle = engine.speculator.drafters.get("eagle")
    if not isinstance(eagle, EagleDrafter):
        return 0
    return sum(loop.num_replays for loop in (eagle.loop, eagle.tree_loop) if loop is not None)


def single_stream(
    engine: LLMEngine, prompts: dict[str, list[list[int]]], rounds: int, max_tokens: int
) -> dict[str, Any]:
    """tokens/s of each kind's prompts one at a time, median over interleaved rounds."""
    per: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METHODS} for k in prompts}
    acceptance: dict[str, dict[str, list[float]]] = {k: {m: [] for m in METHODS} for k in prompts}
    # Where a decode step's time goes, per method: drafting, and the rest (schedule, forward,
    # verification, commit), in ms; and how many steps replayed a graph.
    reports: list[StepReport] = []
    engine.step_listeners.append(reports.append)
    steps: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for kind, kind_prompts in prompts.items():
            for method in METHODS:
                tokens, seconds = 0, 0.0
                replays = getattr(engine.runner, "num_replays", 0)
                drafted = draft_replays(engine)
                reports.clear()
                for p in kind_prompts:
                    n, s, mal = timed_generate(engine, [p], method, max_tokens)
                    tokens, seconds = tokens + n, seconds + s
                    acceptance[kind][method].append(mal)
                per[kind][method].append(tokens / seconds)
                decode = [r for r in reports if r.verified]
                steps[f"{kind}, {method}"] = {
                    "steps": len(reports),
                    "graph_steps": getattr(engine.runner, "num_replays", 0) - replays,
                    "draft_graph_steps": draft_replays(engine) - drafted,
                    "draft_ms": 1000 * statistics.median(r.draft_s for r in decode),
                    "rest_ms": 1000 * statistics.median(r.forward_s for r in decode),
                }
    engine.step_listeners.remove(reports.append)
    return {
        # What a drafting sequence added to a step beyond its priced forwards, as measured
        # (one-token forwards; StepCosts.observe), at the end of the runs.
        "spec_overhead": engine.speculator.costs.overhead,
        "steps": steps,
        "tokens_per_s": {
            k: {m: statistics.median(v) for m, v in d.items()} for k, d in per.items()
        },
        "acceptance": {
            k: {m: statistics.mean(v) for m, v in d.items()} for k, d in acceptance.items()
        },
    }


def concurrency(
    engine: LLMEngine,
    pool: list[list[int]],
    levels: Sequence[int],
    max_tokens: int,
    rounds: int,
) -> dict[str, Any]:
    """tokens/s of each level's requests served together, per method: medians over rounds in
    which the methods run one after another, and the median of each round's ratio to none (a
    run's host is shared and noisy: one sample at 256 requests varied by a third)."""
    rates: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    # Every request max_tokens long (EOS ignored), no speculation: the work transformers'
    # static-cache batch does.
    equal: dict[str, list[float]] = {}
    for level in levels:
        prompts = [pool[i % len(pool)] for i in range(level)]
        timed_generate(engine, prompts, "none", 4)  # warm-up of the prefill shapes
        rates[str(level)] = {m: [] for m in METHODS}
        ratios[str(level)] = {m: [] for m in METHODS}
        for _ in range(rounds):
            for method in METHODS:
                tokens, seconds, _ = timed_generate(engine, prompts, method, max_tokens)
                rates[str(level)][method].append(tokens / seconds)
            for method in METHODS:
                ratio = rates[str(level)][method][-1] / rates[str(level)]["none"][-1]
                ratios[str(level)][method].append(ratio)
            if level in levels[-2:]:
                tokens, seconds, _ = timed_generate(engine, prompts, "none", max_tokens, True)
                equal.setdefault(str(level), []).append(tokens / seconds)
    return {
        "rounds": rounds,
        "max_tokens": max_tokens,
        "equal_work_tokens_per_s": {level: statistics.median(v) for level, v in equal.items()},
        "tokens_per_s": {
            level: {m: statistics.median(v) for m, v in by.items()} for level, by in rates.items()
        },
        "vs_none": {
            level: {m: statistics.median(v) for m, v in by.items()} for level, by in ratios.items()
        },
    }


# -- driver -----------------------------------------------------------------------------------


PARTS = (
    *("environment", "forward", "engine", "single", "concurrency"),
    *("deterministic", "llama_8b_shape", "hf"),
)


def run_part(results: dict[str, Any], name: str, out: Path, fn: Callable[[], Any]) -> None:
    if name.split("_")[0] not in results["parts"] and name not in results["parts"]:
        return
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-4000:]}
        print(results[name]["error"], flush=True)
    results.setdefault("seconds", {})[name] = time.perf_counter() - start
    out.write_text(json.dumps(results, indent=1))
    print(f"   {time.perf_counter() - start:.1f} s", flush=True)


def measure(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "gpu.json"
    results: dict[str, Any] = {
        "parts": args.parts,
        "k": args.k,
        "adaptive": not args.fixed_k,
        "tree_nodes": args.tree_nodes,
        "async_scheduling": args.async_scheduling,
    }
    max_tokens = 8 if args.quick else 128
    rounds = 1 if args.quick else args.rounds
    run_part(results, "environment", out, lambda: environment(device))
    checkpoint = load_checkpoint(dtype=torch.bfloat16)
    tok = checkpoint.tokenizer
    model = build_model(checkpoint, dtype=torch.bfloat16, device=device)
    from tests.benchmarks.bench_gpu_8b import eight_b
    from tests.benchmarks.hf import TransformersPeer
    from tests.benchmarks.spec_prompts import PROMPTS

    prompts = {kind: [chat_ids(tok, t) for t in texts] for kind, texts in PROMPTS.items()}
    pool = [chat_ids(tok, t) for texts in held_out_prompts().values() for t in texts]
    counts = (1, 2, 5) if args.quick else FORWARD_COUNTS
    run_part(results, "forward", out, lambda: forward_costs(model, counts, 5 if args.quick else 20))
    levels = (1, 4) if args.quick else LEVELS
    engine_box: dict[str, LLMEngine] = {}

    def start_engine() -> dict[str, Any]:
        spec = SpecConfig(
            num_speculative_tokens=args.k, adaptive=not args.fixed_k, tree_nodes=args.tree_nodes
        )
        overlap = args.async_scheduling
        engine, seconds = bundled_engine(checkpoint, model, max(levels), spec, overlap)
        freeze_startup_heap()  # as a server does once it has started
        engine_box["engine"] = engine
        runner = engine.runner
        graphs = runner.num_graphs if isinstance(runner, GraphRunner) else 0
        eagle = engine.speculator.drafters["eagle"]
        loops = (eagle.loop, eagle.tree_loop) if isinstance(eagle, EagleDrafter) else ()
        return {
            "startup_s": seconds,
            "graphs": graphs,
            "draft_graphs": sum(loop.num_graphs for loop in loops if loop is not None),
            "tree_costs": engine.speculator.trees.tree_costs,
            "verify_costs": engine.speculator.costs.verify_costs[:8],
            # A draft token for one sequence, and each further sequence's share at a depth,
            # in one-token target forwards: what adaptive k prices EAGLE at.
            "draft_costs": engine.speculator.costs.draft_costs,
            "draft_row_costs": engine.speculator.costs.draft_row_costs,
            "draft_launch_costs": engine.speculator.costs.draft_launch_costs,
        }

    run_part(results, "engine", out, start_engine)
    if "engine" in engine_box:
        engine = engine_box["engine"]
        run_part(results, "single", out, lambda: single_stream(engine, prompts, rounds, max_tokens))
        run_part(
            results,
            "concurrency",
            out,
            lambda: concurrency(engine, pool, levels, max_tokens, rounds),
        )
        del engine, engine_box["engine"]
    gc.unfreeze()  # the engine's cycles may go now
    gc.collect()
    torch.cuda.empty_cache()
    if "deterministic" in args.parts:  # two more engines, the default's and --deterministic's
        from tests.benchmarks.bench_gpu_deterministic import deterministic_part

        run_part(
            results,
            "deterministic",
            out,
            lambda: deterministic_part(
                checkpoint, device, prompts, pool, rounds, max_tokens, args.k
            ),
        )
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_8b and "llama_8b_shape" in args.parts:
        copy = results.get("environment", {}).get("copy_gb_s", 4000.0)
        overlap = args.async_scheduling
        big = functools.partial(eight_b, device, copy, max_tokens, async_scheduling=overlap)
        run_part(results, "llama_8b_shape", out, big)
        torch.cuda.empty_cache()
    if args.skip_hf or "hf" not in args.parts:
        return
    peer = TransformersPeer(checkpoint, max_tokens, device)
    batch = [pool[i % len(pool)] for i in range(4 if args.quick else 64)]
    # Most wanted first: a run cut short keeps the baselines the goals are set against.
    parts: dict[str, Callable[[], Any]] = {
        "hf_static": lambda: peer.single(prompts, rounds, True, cache_implementation="static"),
        "hf_static_batch": lambda: {"batch": len(batch), "tokens_per_s": peer.batch(batch)},
        "hf_eager": lambda: peer.single(prompts, 1, False),
        "hf_lookup": lambda: peer.single(prompts, 1, False, prompt_lookup_num_tokens=10),
    }
    for name, part in parts.items():
        run_part(results, name, out, part)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny run, to check the script")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the engine parts")
    parser.add_argument("--k", type=int, default=K, help="most draft tokens per step")
    parser.add_argument(
        "--parts",
        type=lambda s: s.split(","),
        default=list(PARTS),
        help=f"comma-separated, of {', '.join(PARTS)} (engine is needed by single, concurrency)",
    )
    parser.add_argument(
        "--fixed-k", action="store_true", help="draft k tokens every step (adaptive k off)"
    )
    parser.add_argument(
        "--tree-nodes", type=int, default=0, help="EAGLE drafts trees of up to N nodes (0: chains)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine launches plain decode steps ahead (EngineConfig.async_scheduling)",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        help="write docs/benchmarks.md from these results (a whole run, then runs of some parts)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md",
        help="the report --render writes",
    )
    args = parser.parse_args()
    if args.render is not None:
        from tests.benchmarks.bench_gpu_report import render

        render([json.loads(path.read_text()) for path in args.render], args.output)
        return
    measure(args)


if __name__ == "__main__":
    main()
