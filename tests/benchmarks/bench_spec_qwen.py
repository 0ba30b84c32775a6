"""bench_spec's `--pair qwen` section: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B
(`make models-qwen`), single stream, as served, with whole drafts and with k fixed."""

from __future__ import annotations

import torch

from tests.benchmarks.bench_spec import (
    STAT_COLUMNS,
    build_engine,
    interleaved,
    median_tps,
    merged_stats,
    paired_ratio,
    run_each,
)
from tests.benchmarks.report import table
from tests.benchmarks.spec_prompts import chat_prompts
from workers.engine.config import DEFAULT_MIN_DRAFT_CONFIDENCE
from workers.model.loader import build_model, load_checkpoint


def qwen_pair_section(runs: int, max_tokens: int) -> str:
    """Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (`make models-qwen`), single stream."""
    target_ck = load_checkpoint("qwen2.5-coder-1.5b")
    draft_ck = load_checkpoint("qwen2.5-coder-0.5b")
    target = build_model(target_ck, dtype=torch.bfloat16)
    draft = build_model(draft_ck, dtype=torch.bfloat16)
    # As served (drafts end where the draft model doubts them), and with whole drafts; the
    # engines share the weights.
    engine = build_engine(target, draft, target_ck, min_confidence=DEFAULT_MIN_DRAFT_CONFIDENCE)
    whole = build_engine(target, draft, target_ck)
    tok = target_ck.tokenizer
    prompt_ids = chat_prompts(tok)
    fixed_k = build_engine(target, draft, target_ck, adaptive=False, k=4)
    rows = []
    for kind, ids in prompt_ids.items():
        jobs = {
            m: (lambda m=m, ids=ids: run_each(engine, ids, m, max_tokens))
            for m in ("none", "ngram", "draft_model")
        }
        jobs["draft_model, whole drafts"] = lambda ids=ids: run_each(
            whole, ids, "draft_model", max_tokens
        )
        jobs["draft_model, k = 4 fixed, whole drafts"] = lambda ids=ids: run_each(
            fixed_k, ids, "draft_model", max_tokens
        )
        results = interleaved(runs, jobs, f"qwen pair, {kind}")
        for name, rs in results.items():
            length, k_mean, alpha = merged_stats(rs)
            tps = median_tps(rs)
            rows.append(
                [
                    kind,
                    name,
                    f"{tps:.2f}",
                    f"{paired_ratio(rs, results['none']):.2f}x",
                    f"{length:.2f}",
                    f"{k_mean:.2f}",
                    f"{alpha:.2f}",
                ]
            )
    cost = engine.speculator.costs.draft_costs["draft_model"]
    return (
        "Qwen2.5-Coder-1.5B-Instruct (target) with Qwen2.5-Coder-0.5B-Instruct drafting, both bf16 "
        f"from their GGUFs; a draft token costs {cost:.2f} target forwards here. Adaptive k weighs "
        "that against the measured acceptance; the fixed-k row shows what drafting regardless "
        "would do. `draft_model` is as served: a draft ends where the draft model's probability "
        f"of it falls below {DEFAULT_MIN_DRAFT_CONFIDENCE} (`min_draft_confidence`); the `whole "
        "drafts` rows draft all k.\n\n"
        + table(
            STAT_COLUMNS,
            rows,
        )
    )
