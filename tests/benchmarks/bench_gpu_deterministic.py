"""bench_gpu's deterministic part: what `--deterministic` (batch-invariant projections and
attention: kernels/batch_invariant.py, attention_invariant.py) costs and what it holds, on the
bundled model in bf16, beside the default kernels in the same run.

Two engines, one a mode, each with its own copy of the model, graphs captured, n-gram drafting
and bench_gpu's step budget; rounds alternate between them:
- single stream: tokens/s of bench_spec's prompts one at a time, none and ngram (greedy,
  adaptive k as served);
- concurrent: tokens/s of 16 and 64 held-out prompts served together, none;
- same text: each held-out prompt's greedy tokens alone, then all of them arriving together
  (their prompts cached by then), then together with n-gram speculation: how many differ
  from alone.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tests.benchmarks.bench_gpu import PREFILL_BUDGET, timed_generate
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_drafters
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import Checkpoint, build_model

MODES = ("default", "deterministic")
LEVELS = (16, 64)


def mode_engine(
    checkpoint: Checkpoint, device: torch.device, deterministic: bool, k: int
) -> LLMEngine:
    model = build_model(checkpoint, dtype=torch.bfloat16, device=device)
    config = EngineConfig(
        max_model_len=2048,
        max_num_seqs=max(LEVELS),
        max_num_batched_tokens=PREFILL_BUDGET,
        deterministic=deterministic,
        spec=SpecConfig(num_speculative_tokens=k),
    )
    served = ModelSpec(dtype="bfloat16", device=str(device))  # the factory's ngram drafter
    drafters, _ = build_drafters(served, config, checkpoint.config, checkpoint, model, only="ngram")
    eos = checkpoint.tokenizer.eos_token_ids
    return LLMEngine(model, config, eos_token_ids=eos, drafters=drafters)


def same_text(engine: LLMEngine, pool: list[list[int]], max_tokens: int) -> dict[str, int]:
    """How many of the prompts' greedy outputs differ from their lone run's."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    plain = RequestSpec(enabled=False)
    alone = [engine.generate([p], params, plain)[0].token_ids for p in pool]
    together = [c.token_ids for c in engine.generate(pool, params, plain)]
    drafted = [c.token_ids for c in engine.generate(pool, params, RequestSpec(method="ngram"))]
    return {
        "prompts": len(pool),
        "differ_together": sum(a != b for a, b in zip(alone, together, strict=True)),
        "differ_ngram": sum(a != b for a, b in zip(alone, drafted, strict=True)),
    }


def deterministic_part(
    checkpoint: Checkpoint,
    device: torch.device,
    prompts: dict[str, list[list[int]]],
    pool: list[list[int]],
    rounds: int,
    max_tokens: int,
    k: int,
) -> dict[str, Any]:
    engines = {mode: mode_engine(checkpoint, device, mode == "deterministic", k) for mode in MODES}
    single: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    together: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for _ in range(rounds):
        for mode, engine in engines.items():
            for kind, kind_prompts in prompts.items():
                for method in ("none", "ngram"):
                    runs = [timed_generate(engine, [p], method, max_tokens) for p in kind_prompts]
                    rate = sum(r[0] for r in runs) / sum(r[1] for r in runs)
                    single[mode].setdefault(f"{kind}, {method}", []).append(rate)
            for level in LEVELS:
                batch = [pool[i % len(pool)] for i in range(level)]
                tokens, seconds, _ = timed_generate(engine, batch, "none", max_tokens)
                together[mode].setdefault(str(level), []).append(tokens / seconds)
    return {
        "max_tokens": max_tokens,
        "single_tokens_per_s": {
            m: {row: statistics.median(v) for row, v in by.items()} for m, by in single.items()
        },
        "concurrent_tokens_per_s": {
            m: {lv: statistics.median(v) for lv, v in by.items()} for m, by in together.items()
        },
        "same_text": {m: same_text(e, pool[:16], max_tokens) for m, e in engines.items()},
    }
