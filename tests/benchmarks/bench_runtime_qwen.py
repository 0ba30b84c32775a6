"""bench_runtime's `--pair qwen` section: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B
(`make models-qwen`) through the disaggregated runtime, with drafting ahead off, stopping and
going on, beside the in-process engine; the two models' forwards at once; remote prefill."""

from __future__ import annotations

import argparse

import torch

from tests.benchmarks.bench_runtime import (
    AHEAD,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    QWEN,
    ROW_COLUMNS,
    K,
    compare,
    deployment,
    encode_chats,
    goals_table,
    prefill_section,
)
from tests.benchmarks.concurrency import concurrency_section
from tests.benchmarks.report import machine_line, table, write_section
from workers.eagle.prompts import held_out_prompts
from workers.engine.config import DEFAULT_MIN_DRAFT_CONFIDENCE, EngineConfig, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_tokenizer


def qwen_pair(args: argparse.Namespace, params: SamplingParams) -> None:
    """The `bench_runtime_qwen` section: Qwen2.5-Coder-0.5B drafting for the 1.5B."""
    torch.set_num_threads(1)  # the same one core the verifier actor gets
    spec = SpecConfig(method="draft_model", num_speculative_tokens=K, adaptive=False)
    local = build_engine(
        ModelSpec(model=QWEN.target, dtype="bfloat16", draft_model=QWEN.draft),
        EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, spec=spec),
        progress=False,
    )
    draft_cost = local.engine.speculator.costs.draft_costs["draft_model"]
    count = 1 if args.quick else 2
    prompts = {
        kind: encode_chats(local.tokenizer, held_out_prompts()[kind][:count])
        for kind in ("code", "chat")
    }
    rows, results = [], {}
    for ahead in AHEAD:
        config = deployment("draft_model", ahead=ahead, models=QWEN)
        for kind, measured in compare(local.engine, config, prompts, params, args.runs).items():
            results[(kind, ahead)] = measured
            rows.append([kind, ahead, *measured.row()[:-1]])
    rows.sort(key=lambda row: row[0] != "code")  # each kind's three runtimes together
    del local
    both_table, target_slowdown = concurrency_section(
        QWEN.target, QWEN.draft, K, rounds=1 if args.quick else 3
    )
    ttft_table, ttft_overhead = prefill_section(
        load_tokenizer(QWEN.target), args.runs, args.quick, "draft_model", QWEN
    )
    body = "\n\n".join(
        [
            "## Disaggregated runtime: a real draft/target pair\n\n"
            "`python -m tests.benchmarks.bench_runtime --pair qwen`",
            f"Machine: {machine_line()}. Qwen2.5-Coder-1.5B-Instruct (target) with "
            "Qwen2.5-Coder-0.5B-Instruct drafting (`make models-qwen`), both bf16 from their "
            f"GGUFs; a draft token costs {draft_cost:.2f} target forwards here. Greedy, k = {K} "
            f"fixed (drafts ended below confidence {DEFAULT_MIN_DRAFT_CONFIDENCE}), single "
            f"stream over {count} held-out code and {count} chat prompts, up to "
            f"{args.max_tokens} new tokens, medians of {args.runs} interleaved runs per prompt; "
            "in-process and runtime as in the section above (one core each). This is the case "
            "drafting ahead is for: a drafter that costs the verifier most of a step when "
            "drafting in-line, and whole drafts accepted often enough that the guess comes true. "
            "In the time of one verify forward alone the drafter makes about "
            f"{1 / draft_cost:.1f} draft forwards ahead (the guessed bonus token, then the "
            "draft), fewer while the two forwards share the memory bandwidth (below). Three "
            "runtimes, each beside the in-process engine: no drafting ahead; drafting ahead that "
            "`stops` (`pools.drafter.keep_drafting_ahead: false`: every step stops the "
            "drafter's thread at the end of the forward under way, and a commit equal to the "
            "guess is answered with the prepared draft); and drafting ahead that `goes on` (the "
            "default: a step that only commits the guess is answered from the chain drafted so "
            "far while drafting goes on, `served while drafting went on`, once the chain holds "
            "the whole draft an in-line proposal would make).",
            table(["prompts", "drafting ahead", *ROW_COLUMNS[:-1]], rows),
            "### Running both at once",
            "Outside the runtime, two Ray actors of one CPU each: the 1.5B's verify forward "
            f"({K + 1} new tokens) and the 0.5B's one-token forward, each timed alone and beside "
            "the other's forward loop, in interleaved rounds (tests/benchmarks/concurrency.py). "
            "Both stream their weights from memory and share its bandwidth: beside the drafter "
            f"the verify forward took {target_slowdown:.2f}x its time alone (compare the "
            "runtime's `verify forward per step` above).",
            both_table,
            "### Remote prefill",
            "As in the section above, with the 1.5B target (no features: the draft model reads "
            "none).",
            ttft_table,
            "### Goals",
            goals_table(results, ttft_overhead),
        ]
    )
    print(body)
    write_section("bench_runtime_qwen", body, args.output)
