"""The disaggregated runtime vs the in-process engine, side by side in one run.

    python -m tests.benchmarks.bench_runtime [--runs 3] [--max-tokens 96]

Single stream, bf16, greedy, the held-out chat prompts. For each drafter method: the in-process
engine (drafting and verifying on the same cores, one after the other) and the Ray runtime (the
verifier actor on one core, the drafter actor on the other, features over a gloo link), with the
drafter drafting ahead and without. Also the fraction of verify steps that went without a draft
because the drafter missed its deadline, the proposals served from drafting ahead, and the
feature bytes moved per step. Writes the `bench_runtime` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from cluster.config import DeploymentConfig, from_dict
from cluster.runtime import Runtime
from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section
from workers.eagle.prompts import held_out_prompts
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

METHODS = ("draft_model", "eagle")
DRAFT_LAYERS = 12
K = 4


def deployment(method: str, prefill: int = 0, draft_ahead: bool = True) -> DeploymentConfig:
    return from_dict(
        {
            "dtype": "bfloat16",
            "speculative": {"method": method, "num_speculative_tokens": K, "adaptive": False},
            "pools": {
                "prefill": {"replicas": prefill, "min_remote_prompt_tokens": 1},
                "verifier": {"resources": {"cpus": 1}},
                "drafter": {
                    "replicas": 1,
                    "method": method,
                    "draft_layers": DRAFT_LAYERS,
                    "draft_ahead": draft_ahead,
                    "resources": {"cpus": 1},
                },
            },
        }
    )


LONG_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres. It supports a wide "
    "diversity of life and was selected as a World Heritage Site in 1981. "
)


def time_to_first_token(runtime: Runtime, prompts: list[list[int]]) -> float:
    """Median over the prompts after the first (a warm-up); each prompt is new to the prefix
    cache, so every run prefills for real."""
    one = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        for _ in runtime.submit(prompt, one, RequestSpec(enabled=False)):
            break
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def prefill_section(tok, runs: int, quick: bool) -> tuple[str, float]:
    """TTFT of long prompts prefilled on the verifier vs on a prefill worker, and the
    K/V transfer that the remote path costs."""
    repeats = 1 if quick else 6

    def prompts(tag: str) -> list[list[int]]:
        texts = [
            f"({tag} {i}) Summarize this text:\n\n{LONG_TEXT * repeats}" for i in range(runs + 1)
        ]
        return [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts
        ]

    local_rt = Runtime.start(deployment("eagle", prefill=0), num_cpus=3)
    try:
        local = time_to_first_token(local_rt, prompts("local"))
    finally:
        local_rt.shutdown()
    remote_rt = Runtime.start(deployment("eagle", prefill=1), num_cpus=3)
    try:
        remote = time_to_first_token(remote_rt, prompts("remote"))
        (stats,) = remote_rt.verifier_stats()
    finally:
        remote_rt.shutdown()
    p = stats["prefill"]
    n = max(1, p["remote"])
    overhead = remote / local - 1
    text_table = table(
        [
            "prompt tokens",
            "TTFT, verifier prefills",
            "TTFT, prefill worker",
            "overhead",
            "K/V + features per prompt",
            "compute on the worker",
            "transfer",
        ],
        [
            [
                len(prompts("local")[0]),
                f"{local * 1000:.0f} ms",
                f"{remote * 1000:.0f} ms",
                f"{overhead:+.0%}",
                f"{p['bytes'] / n / 2**20:.2f} MiB",
                f"{p['compute_s'] / n * 1000:.0f} ms",
                f"{p['transfer_s'] / n * 1000:.1f} ms",
            ]
        ],
    )
    return text_table, overhead


def compare(
    engine: LLMEngine,
    config: DeploymentConfig,
    prompts: list[list[int]],
    params: SamplingParams,
    runs: int,
) -> tuple[list[float], list[float], dict]:
    """Tokens/s of the in-process engine and of a runtime built from `config`, interleaved per
    prompt after a warm-up round; and the runtime's verifier stats."""
    method = config.pools.drafter.method
    runtime = Runtime.start(config, num_cpus=2)
    local_tps: list[float] = []
    remote_tps: list[float] = []
    try:
        for round_ in range(runs + 1):
            for prompt in prompts:
                start = time.perf_counter()
                done = engine.generate([prompt], params, RequestSpec(method=method))
                local_s = time.perf_counter() - start
                start = time.perf_counter()
                stream = runtime.submit(prompt, params, RequestSpec(method=method))
                n = sum(len(c) for c in stream)
                remote_s = time.perf_counter() - start
                if round_:
                    local_tps.append(len(done[0].token_ids) / local_s)
                    remote_tps.append(n / remote_s)
            print(f"[bench_runtime] {method}: round {round_}/{runs}", file=sys.stderr)
        (stats,) = runtime.verifier_stats()
    finally:
        runtime.shutdown()
    return local_tps, remote_tps, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--prefill-only", action="store_true", help="only the remote-prefill table (rewrites it)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens = 1, 8
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    rows = []
    ratios = {}
    if args.prefill_only:
        from workers.model.loader import load_checkpoint

        ttft_table, overhead = prefill_section(load_checkpoint().tokenizer, args.runs, args.quick)
        print(ttft_table)
        text = args.output.read_text()
        start = text.index("### Remote prefill")
        end = text.index("### Goals", start)
        head, tail = text[:start], text[end:]
        table_start = text.index("| prompt tokens", start)
        table_end = text.index("\n\n", table_start)
        text = text[:table_start] + ttft_table + text[table_end:]
        text = re.sub(
            r"(remote-prefill TTFT overhead \| <= 10% \| )[^|]*\|", rf"\g<1>{overhead:+.0%} |", text
        )
        args.output.write_text(text)
        del head, tail
        return
    for method in METHODS:
        spec = SpecConfig(method=method, num_speculative_tokens=K, adaptive=False)
        torch.set_num_threads(1)  # the same one core the verifier actor gets
        local = build_engine(
            ModelSpec(dtype="bfloat16", draft_layers=DRAFT_LAYERS),
            EngineConfig(max_model_len=1024, max_num_seqs=8, spec=spec),
            progress=False,
        )
        tok = local.tokenizer
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
            for p in held_out_prompts()["chat"][: 1 if args.quick else 3]
        ]
        # One Ray runtime at a time: each is measured interleaved with the in-process engine,
        # and compared with it.
        for ahead in (False, True):
            local_tps, remote_tps, stats = compare(
                local.engine, deployment(method, draft_ahead=ahead), prompts, params, args.runs
            )
            remote = stats["remote_drafting"]
            steps = max(1, remote["steps"])
            lo, hi = statistics.median(local_tps), statistics.median(remote_tps)
            ratios[(method, ahead)] = hi / lo
            rows.append(
                [
                    method,
                    "yes" if ahead else "no",
                    f"{lo:.1f}",
                    f"{hi:.1f}",
                    f"{hi / lo:.2f}x",
                    f"{stats['spec']['mean_acceptance_length']:.2f}",
                    f"{remote['late'] / steps:.1%}",
                    f"{remote['ahead_served'] / steps:.1%}",
                    f"{remote['feature_bytes'] / steps / 1024:.1f}",
                ]
            )
    ttft_table, ttft_overhead = prefill_section(tok, args.runs, args.quick)
    body = "\n\n".join(
        [
            "## Disaggregated runtime\n\n`python -m tests.benchmarks.bench_runtime`",
            f"Machine: {machine_line()}. Bundled model, bf16, greedy, k = {K} fixed, single "
            f"stream over held-out chat prompts, up to {args.max_tokens} new tokens, medians of "
            f"{args.runs} interleaved runs per prompt. In-process: the engine with its drafter on "
            "one core (torch threads = 1). Runtime: the verifier actor (1 CPU) and one drafter "
            f"actor (1 CPU), features over a gloo link; draft_model is the first {DRAFT_LAYERS} "
            "layers. Drafting ahead: while the verifier checks a draft, the drafter prepares the "
            "next one on the guess that the whole draft is accepted and its own bonus token is "
            "right; `served ahead` is the share of steps whose draft was ready that way. The "
            "in-process engine is measured interleaved with each runtime; each runtime is "
            "compared with the in-process runs beside it.",
            table(
                [
                    "drafter",
                    "drafting ahead",
                    "in-process tokens/s",
                    "runtime tokens/s",
                    "runtime vs in-process",
                    "mean acceptance length",
                    "steps without a draft (late)",
                    "served ahead",
                    "feature KiB per step",
                ],
                rows,
            ),
            "### Remote prefill",
            "Long prompts, each new to the prefix cache, `max_tokens` 1, no speculation: median "
            "time to the first token when the verifier prefills and when the prefill worker does "
            "(the whole prompt: K/V into the verifier's blocks, EAGLE's three feature layers and "
            "the last position's logits, over a gloo link on loopback; the verifier samples the "
            "first token from those logits without a forward). The overhead is the transfer, "
            "the extra Ray round trip and writing the K/V into the blocks; compute on the worker "
            "is a mean over all prompts, the warm-up included.",
            ttft_table,
            "### Goals",
            table(
                ["goal", "target", "measured"],
                [
                    [
                        "runtime vs in-process with a model drafter",
                        ">= 1.15x",
                        ", ".join(f"{m} {r:.2f}x" for (m, ahead), r in ratios.items() if ahead),
                    ],
                    ["remote-prefill TTFT overhead", "<= 10%", f"{ttft_overhead:+.0%}"],
                ],
            ),
        ]
    )
    print(body)
    write_section("bench_runtime", body, args.output)


if __name__ == "__main__":
    main()
