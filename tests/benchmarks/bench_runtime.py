"""The disaggregated runtime vs the in-process engine, side by side in one run.

    python -m tests.benchmarks.bench_runtime [--runs 3] [--max-tokens 96] [--pair qwen]

Single stream, bf16, greedy, the held-out chat prompts. For each drafter method: the in-process
engine (drafting and verifying on the same cores, one after the other) and the Ray runtime (the
verifier actor on one core, the drafter actor on the other, features over a gloo link), with the
drafter drafting ahead and without (and, with `--pair qwen`, drafting ahead that stops at
every step beside drafting ahead that goes on). Also the fraction of verify steps that went
without a draft because the drafter missed its deadline, the proposals served from drafting
ahead, and the feature bytes moved per step. Writes the `bench_runtime` section of
docs/benchmarks.md.

`--pair qwen`: instead, Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (`make models-qwen`),
the draft-model case with a drafter worth hiding, on held-out code and chat prompts; writes the
`bench_runtime_qwen` section.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import DeploymentConfig, from_dict
from cluster.runtime import Runtime
from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section
from workers.eagle.prompts import held_out_prompts
from workers.engine.config import (
    DEFAULT_MIN_DRAFT_CONFIDENCE,
    EngineConfig,
    RequestSpec,
    SpecConfig,
)
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StepReport
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_tokenizer

METHODS = ("draft_model", "eagle")
DRAFT_LAYERS = 12
K = 4
MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 8  # the in-process engine's too
QWEN_TARGET, QWEN_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@dataclass(frozen=True, slots=True)
class Models:
    """The target, and the draft model of method draft_model (None: the target's first
    DRAFT_LAYERS layers)."""

    target: str | None = None
    draft: str | None = None

    def draft_settings(self) -> dict[str, object]:
        return {"draft_model": self.draft} if self.draft else {"draft_layers": DRAFT_LAYERS}


BUNDLED, QWEN = Models(), Models(QWEN_TARGET, QWEN_DRAFT)


# How the drafter actor drafts ahead, by the label in the tables: (draft_ahead,
# keep_drafting_ahead). "stops" ends drafting ahead at every step (the prepared draft is served
# once the forward under way ends); "goes on" answers a step that only commits the guess from
# the chain drafted so far and keeps drafting (a draft model; EAGLE always stops).
AHEAD = {"no": (False, False), "stops": (True, False), "goes on": (True, True)}


def deployment(
    method: str, prefill: int = 0, ahead: str = "goes on", models: Models = BUNDLED
) -> DeploymentConfig:
    draft_ahead, keep_going = AHEAD[ahead]
    return from_dict(
        {
            "model": models.target,
            "dtype": "bfloat16",
            "engine": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS},
            "speculative": {"method": method, "num_speculative_tokens": K, "adaptive": False},
            "pools": {
                "prefill": {"replicas": prefill, "min_remote_prompt_tokens": 1},
                "verifier": {"resources": {"cpus": 1}},
                "drafter": {
                    "replicas": 1,
                    "method": method,
                    "draft_ahead": draft_ahead,
                    "keep_drafting_ahead": keep_going,
                    "resources": {"cpus": 1},
                    **models.draft_settings(),
                },
            },
        }
    )


LONG_TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres. It supports a wide "
    "diversity of life and was selected as a World Heritage Site in 1981. "
)


PREFILL_NOTE = (
    "Long prompts, each new to the prefix cache, `max_tokens` 1, no speculation: median time to "
    "the first token when the verifier prefills and when the prefill worker does (the whole "
    "prompt: K/V into the verifier's blocks, EAGLE's three feature layers and the last "
    "position's logits, over a gloo link on loopback; the verifier samples the first token from "
    "those logits without a forward). The same prompts on each runtime; runtimes with and "
    "without the worker take turns, two rounds. The worker sends each layer's K/V as soon as "
    "the prompt has passed that layer, so `transfer` is only what is left after its forward. "
    "The overhead is the extra Ray round trip, the transfer's share of the two cores during the "
    "forward and writing the K/V into the blocks; both sides skip the prompts' shared start (the "
    "system prompt), the verifier from its prefix cache, the worker from the prompt it computed "
    "last. `compute on the worker` is a mean over all prompts, warm-ups included."
)


def time_to_first_token(runtime: Runtime, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first token of each prompt after the first (a warm-up); each prompt is
    new to the prefix cache, so every run prefills for real."""
    one = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        for _ in runtime.submit(prompt, one, RequestSpec(enabled=False)):
            break
        times.append(time.perf_counter() - start)
    return times[1:]


def prefill_section(
    tok, runs: int, quick: bool, method: str = "eagle", models: Models = BUNDLED
) -> tuple[str, float]:
    """TTFT of long prompts prefilled on the verifier vs on a prefill worker, and the
    K/V transfer that the remote path costs. Runtimes with and without a prefill worker take
    turns (two rounds each), so that the machine's drift lands on both."""
    repeats = 1 if quick else 6
    # The same prompts on every runtime (each starts with an empty prefix cache): the same
    # lengths, so the same attention shapes (the CPU kernel's speed depends on them).
    texts = [
        f"({i}) Summarize this text:\n\n{LONG_TEXT * repeats}" for i in range(max(runs, 6) + 1)
    ]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    ttft: dict[int, list[float]] = {0: [], 1: []}
    totals: dict[str, float] = {}
    for _ in range(1 if quick else 2):
        for workers in (0, 1):
            runtime = Runtime.start(deployment(method, prefill=workers, models=models), num_cpus=3)
            try:
                ttft[workers] += time_to_first_token(runtime, prompts)
                (stats,) = runtime.verifier_stats()
            finally:
                runtime.shutdown()
            for key in ("remote", "bytes", "compute_s", "transfer_s"):
                totals[key] = totals.get(key, 0.0) + stats["prefill"][key]
    local, remote = statistics.median(ttft[0]), statistics.median(ttft[1])
    n = max(1, totals["remote"])
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
                len(prompts[0]),
                f"{local * 1000:.0f} ms",
                f"{remote * 1000:.0f} ms",
                f"{overhead:+.0%}",
                f"{totals['bytes'] / n / 2**20:.2f} MiB",
                f"{totals['compute_s'] / n * 1000:.0f} ms",
                f"{totals['transfer_s'] / n * 1000:.1f} ms",
            ]
        ],
    )
    return text_table, overhead


@dataclass(slots=True)
class Measured:
    """One kind of prompt on one runtime, beside the in-process engine."""

    local_tps: list[float]
    remote_tps: list[float]
    accepted: int = 0
    verify_steps: int = 0
    steps: int = 0  # proposals asked of the drafter
    late: int = 0
    ahead_served: int = 0
    ahead_kept_going: int = 0  # steps served while the drafter's drafting ahead went on
    feature_bytes: int = 0
    draft_s: float = 0.0  # inside the drafter actor
    handled_s: float = 0.0  # the drafter actor's whole steps, drafting included
    wait_s: float = 0.0  # the verifier's wait for the drafter's replies
    local_draft_s: float = 0.0  # the in-process engine's drafting, over its verify steps
    local_forward_s: float = 0.0  # and its forwards with verification, over the same steps
    local_steps: int = 0
    local_drafted: int = 0  # the draft tokens of those steps
    verify_steps_timed: int = 0  # the runtime verifier's verify steps (StepTimes)
    verify_forward_s: float = 0.0  # and their forwards with verification

    @property
    def ratio(self) -> float:
        """Median over prompts and rounds of the runtime's tokens/s over the in-process
        engine's run right before it on the same prompt (a ratio of medians would set one
        run's slow moment against another's fast one)."""
        return statistics.median(
            r / loc for r, loc in zip(self.remote_tps, self.local_tps, strict=True)
        )

    @property
    def bound(self) -> float:
        """The most a runtime could gain over the in-process engine by hiding drafting: the
        in-process verify steps' time over their time without drafting (so at the same
        acceptance, with no hand-off and every draft ready when asked for)."""
        return (self.local_draft_s + self.local_forward_s) / max(1e-9, self.local_forward_s)

    @property
    def pace_bound(self) -> float:
        """The most a runtime with one drafter could gain by drafting ahead: a drafter that
        goes on drafting makes one chain token (guess or draft) per draft forward, so its
        drafts cannot carry the stream faster than one token per draft forward (timed in the
        in-process engine, on the same one core as the drafter actor gets). Relative to the
        in-process engine's tokens/s."""
        per_token = self.local_draft_s / max(1, self.local_drafted)
        return 1 / max(1e-9, per_token * statistics.median(self.local_tps))

    def row(self) -> list[str]:
        steps = max(1, self.steps)
        length = (self.accepted + self.verify_steps) / max(1, self.verify_steps)
        return [
            f"{statistics.median(self.local_tps):.1f}",
            f"{statistics.median(self.remote_tps):.1f}",
            f"{self.ratio:.2f}x",
            f"{self.bound:.2f}x",
            f"{self.pace_bound:.2f}x",
            f"{length:.2f}",
            f"{self.late / steps:.1%}",
            f"{self.ahead_served / steps:.1%}",
            f"{self.ahead_kept_going / steps:.1%}",
            f"{self.local_forward_s / max(1, self.local_steps) * 1000:.0f} / "
            f"{self.verify_forward_s / max(1, self.verify_steps_timed) * 1000:.0f} ms",
            f"{self.local_draft_s / max(1, self.local_steps) * 1000:.1f} ms",
            f"{self.draft_s / steps * 1000:.1f} ms",
            f"{(self.wait_s - self.draft_s) / steps * 1000:.1f} ms",
            f"{max(0.0, self.wait_s - self.handled_s) / steps * 1000:.2f} ms",
            f"{self.feature_bytes / steps / 1024:.1f}",
        ]


ROW_COLUMNS = [
    "in-process tokens/s",
    "runtime tokens/s",
    "runtime vs in-process",
    "bound with drafting hidden",
    "bound at the drafter's pace",
    "mean acceptance length",
    "steps without a draft (late)",
    "served ahead",
    "served while drafting went on",
    "verify forward per step, in-process / runtime",
    "drafting per step, in-process",
    "drafting per step, drafter actor",
    "hand-off per step",
    "of which transport",
    "feature KiB per step",
]


def compare(
    engine: LLMEngine,
    config: DeploymentConfig,
    prompts: dict[str, list[list[int]]],
    params: SamplingParams,
    runs: int,
) -> dict[str, Measured]:
    """Tokens/s of the in-process engine and of a runtime built from `config`, interleaved per
    prompt after a warm-up round, one kind of prompt after another; and the runtime's verifier
    counters over each kind (its warm-up round included)."""
    method = config.pools.drafter.method
    runtime = Runtime.start(config, num_cpus=2)
    results: dict[str, Measured] = {}
    # The in-process engine's verify steps: (drafting, forward) seconds, draft tokens.
    step_s: list[tuple[float, float, int]] = []

    def listen(report: StepReport) -> None:
        if report.verified:
            drafted = sum(r.drafted for r in report.rounds)
            step_s.append((report.draft_s, report.forward_s, drafted))

    engine.step_listeners.append(listen)
    try:
        before = _counters(runtime)
        for kind, kind_prompts in prompts.items():
            measured = results[kind] = Measured([], [])
            for round_ in range(runs + 1):
                for prompt in kind_prompts:
                    step_s.clear()
                    start = time.perf_counter()
                    done = engine.generate([prompt], params, RequestSpec(method=method))
                    local_s = time.perf_counter() - start
                    if round_:
                        measured.local_draft_s += sum(d for d, _, _ in step_s)
                        measured.local_forward_s += sum(f for _, f, _ in step_s)
                        measured.local_drafted += sum(n for _, _, n in step_s)
                        measured.local_steps += len(step_s)
                    start = time.perf_counter()
                    stream = runtime.submit(prompt, params, RequestSpec(method=method))
                    n = sum(len(c) for c in stream)
                    remote_s = time.perf_counter() - start
                    if round_:
                        measured.local_tps.append(len(done[0].token_ids) / local_s)
                        measured.remote_tps.append(n / remote_s)
                print(f"[bench_runtime] {method} {kind}: round {round_}/{runs}", file=sys.stderr)
            after = _counters(runtime)
            for name, value in after.items():
                setattr(measured, name, value - before[name])
            before = after
    finally:
        engine.step_listeners.remove(listen)
        runtime.shutdown()
    return results


COUNTERS = (
    "steps",
    "late",
    "ahead_served",
    "ahead_kept_going",
    "feature_bytes",
    "draft_s",
    "handled_s",
    "wait_s",
)


def _counters(runtime: Runtime) -> dict[str, float]:
    (stats,) = runtime.verifier_stats()
    spec, remote, steps = stats["spec"], stats["remote_drafting"], stats["steps"]
    return {
        "accepted": spec["accepted"],
        "verify_steps": spec["verify_steps"],
        "verify_steps_timed": steps["verify_steps"],
        "verify_forward_s": steps["verify_forward_s"],
        **{k: remote[k] for k in COUNTERS},
    }


def goals_table(measured_by: dict[tuple[str, str], Measured], ttft_overhead: float) -> str:
    """The issue's goals: each runtime drafting ahead (by its label, and how it drafts ahead
    where there is more than one way) against the in-process engine, beside the most that
    hiding drafting could give, and the remote-prefill TTFT overhead."""
    ways = {ahead for _, ahead in measured_by if ahead != "no"}
    measured = ", ".join(
        f"{label}{f' ({ahead})' if len(ways) > 1 else ''} {m.ratio:.2f}x "
        f"(bounds {m.bound:.2f}x, {m.pace_bound:.2f}x at the drafter's pace)"
        for (label, ahead), m in measured_by.items()
        if ahead != "no"
    )
    return table(
        ["goal", "target", "measured"],
        [
            ["runtime vs in-process with a model drafter", ">= 1.15x", measured],
            ["remote-prefill TTFT overhead", "<= 10%", f"{ttft_overhead:+.0%}"],
        ],
    )


def encode_chats(tok, texts: list[str]) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def replace_prefill_table(report: Path, ttft_table: str, overhead: float) -> None:
    """Rewrite only the remote-prefill part of the `bench_runtime` section."""
    text = report.read_text()
    begin, end = (
        text.index("<!-- bench_runtime:start -->"),
        text.index("<!-- bench_runtime:end -->"),
    )
    section = text[begin:end]
    start = section.index("### Remote prefill\n\n") + len("### Remote prefill\n\n")
    table_end = section.index("\n\n", section.index("| prompt tokens", start))
    section = section[:start] + PREFILL_NOTE + "\n\n" + ttft_table + section[table_end:]
    section = re.sub(
        r"(remote-prefill TTFT overhead \| <= 10% \| )[^|]*\|", rf"\g<1>{overhead:+.0%} |", section
    )
    report.write_text(text[:begin] + section + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--prefill-only", action="store_true", help="only the remote-prefill table (rewrites it)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    parser.add_argument(
        "--pair", choices=["qwen"], help="instead: the Qwen2.5-Coder pair (make models-qwen)"
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens = 1, 8
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    if args.pair:
        from tests.benchmarks.bench_runtime_qwen import qwen_pair

        qwen_pair(args, params)
        return
    rows = []
    results = {}
    if args.prefill_only:
        ttft_table, overhead = prefill_section(load_tokenizer(), args.runs, args.quick)
        print(ttft_table)
        replace_prefill_table(args.output, ttft_table, overhead)
        return
    for method in METHODS:
        spec = SpecConfig(method=method, num_speculative_tokens=K, adaptive=False)
        torch.set_num_threads(1)  # the same one core the verifier actor gets
        local = build_engine(
            ModelSpec(dtype="bfloat16", draft_layers=DRAFT_LAYERS),
            EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, spec=spec),
            progress=False,
        )
        tok = local.tokenizer
        prompts = {"chat": encode_chats(tok, held_out_prompts()["chat"][: 1 if args.quick else 3])}
        # One Ray runtime at a time: each is measured interleaved with the in-process engine,
        # and compared with it.
        for ahead in ("no", "goes on"):  # the default; EAGLE stops at every step regardless
            config = deployment(method, ahead=ahead)
            measured = compare(local.engine, config, prompts, params, args.runs)["chat"]
            results[(method, ahead)] = measured
            rows.append([method, "yes" if ahead != "no" else "no", *measured.row()])
    ttft_table, ttft_overhead = prefill_section(tok, args.runs, args.quick)
    body = "\n\n".join(
        [
            "## Disaggregated runtime\n\n`python -m tests.benchmarks.bench_runtime`",
            f"Machine: {machine_line()}. Bundled model, bf16, greedy, k = {K} fixed (a model "
            "draft ends sooner where the drafter's probability of it falls below "
            f"{DEFAULT_MIN_DRAFT_CONFIDENCE}, as served), single "
            f"stream over held-out chat prompts, up to {args.max_tokens} new tokens, medians of "
            f"{args.runs} interleaved runs per prompt. In-process: the engine with its drafter on "
            "one core (torch threads = 1). Runtime: the verifier actor (1 CPU) and one drafter "
            f"actor (1 CPU), features over a gloo link; draft_model is the first {DRAFT_LAYERS} "
            "layers. Drafting ahead: while the verifier checks a draft, the drafter prepares the "
            "next one on the guess that the whole draft is accepted and its own bonus token is "
            "right; `served ahead` is the share of steps whose draft was ready that way, and "
            "`served while drafting went on` the share answered from a draft model's chain "
            "without stopping its drafting ahead (base.py `take_ahead`). The "
            "in-process engine is measured interleaved with each runtime, the same prompt on "
            "one right before the other; `runtime vs in-process` is the median of those pairs' "
            "ratios. `bound with drafting hidden`: the in-process engine's verify steps' time "
            "over their time without the drafting in them, the most a runtime could gain by "
            "hiding drafting (at the same acceptance, with no hand-off and every draft ready "
            "when asked for). `bound at the drafter's pace`: a drafter drafting ahead makes one "
            "token of its chain (guess or draft) per draft forward, so one drafter cannot carry "
            "the stream faster than that; one over the in-process draft forward's time per "
            "token, over the in-process tokens/s. `verify forward per step`: the target's "
            "forward with verification in a step that verified, in the in-process engine and in "
            "the verifier actor, where a drafter drafting ahead beside it shares the memory "
            "bandwidth. `drafting per step`: in the in-process "
            "engine's step, and inside the drafter actor (a draft served ahead costs none there "
            "but the wait for the forwards that complete it, when a chain does not hold it all "
            "yet); "
            "`hand-off per step`: what the "
            "verifier waits for a proposal beyond the drafting in it (taking in the feature rows "
            "and events, waiting for a forward drafting ahead had under way, and the transport); "
            "`of which transport`: the part outside the drafter actor, the step's message and "
            "reply over the pair's step channel (cluster/step_channel.py; a Ray call per step "
            "cost 2-3 ms here).",
            table(["drafter", "drafting ahead", *ROW_COLUMNS], rows),
            "### Remote prefill",
            PREFILL_NOTE,
            ttft_table,
            "### Goals",
            goals_table(results, ttft_overhead),
        ]
    )
    print(body)
    write_section("bench_runtime", body, args.output)


if __name__ == "__main__":
    main()
