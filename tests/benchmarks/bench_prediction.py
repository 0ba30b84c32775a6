"""What a predicted output (OpenAI's `prediction`) buys, on the bundled model.

    python -m tests.benchmarks.bench_prediction [--runs 3] [--max-tokens 128]

Single stream, bf16, greedy, chat template, the engine as `outrider serve` builds it (adaptive
k, EAGLE with prompt lookup). Two kinds of request: a chat answer asked again with the first
answer as the prediction (a client regenerating, or checking a cached answer), and the code
edits of bench_spec with the code as sent as the prediction (the answer is that code with an
edit, after a line or two of prose). Each with no speculation, with a drafter and no
prediction, with the prediction, and with a wrong one (the other kind's prediction). Writes the
`bench_prediction` section of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from tests.benchmarks.report import bench_args, bench_parser, machine_line, table, write_section
from tests.benchmarks.spec_prompts import CODE, JS, PROMPTS, SCRIPT
from workers.eagle.prompts import HELD_OUT
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams

K = 4  # as served; the `up to 16` rows let adaptive k go further
# (label, method, which prediction, most drafts a step)
CONFIGS = [
    ("none", "none", "none", 0),
    ("ngram", "ngram", "none", K),
    ("ngram", "ngram", "right", K),
    ("ngram, up to 16", "ngram", "none", 16),
    ("ngram, up to 16", "ngram", "right", 16),
    ("ngram", "ngram", "wrong", K),
    ("eagle", "eagle", "none", K),
    ("eagle", "eagle", "right", K),
    ("eagle, up to 16", "eagle", "right", 16),
]


@dataclass(slots=True)
class Run:
    seconds: float = 0.0
    completions: list[Completion] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def run_requests(
    engine: LLMEngine,
    prompts: list[list[int]],
    predictions: list[tuple[int, ...]],
    config: tuple[str, str, str, int],
    max_tokens: int,
) -> Run:
    """Each request alone (single stream), one after the other."""
    _, method, _, k = config
    spec = (
        RequestSpec(enabled=False)
        if method == "none"
        else RequestSpec(method=method, num_speculative_tokens=k)
    )
    run = Run()
    for prompt, prediction in zip(prompts, predictions, strict=True):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, prediction=prediction)
        start = time.perf_counter()
        run.completions += engine.generate([prompt], params, spec)
        run.seconds += time.perf_counter() - start
    return run


def main() -> None:
    args = bench_args(bench_parser(__doc__))
    config = EngineConfig(
        max_model_len=1024, spec=SpecConfig(method="eagle", num_speculative_tokens=K)
    )
    loaded = build_engine(ModelSpec(dtype="bfloat16"), config, progress=False)
    engine, tok = loaded.engine, loaded.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    def encoded(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    prompts = {
        "chat, asked again": [chat(t) for t in HELD_OUT["chat"][:4]],
        "code edit": [chat(t) for t in PROMPTS["code edit"]],
    }
    with torch.inference_mode():
        first = run_requests(
            engine, prompts["chat, asked again"], [()] * 4, CONFIGS[0], args.max_tokens
        )
    right = {
        "chat, asked again": [tuple(c.token_ids) for c in first.completions],
        "code edit": [encoded(code) for code in (CODE, SCRIPT, JS)],
    }
    # A wrong prediction: the other kind's, as long as the right one.
    wrong = {
        "chat, asked again": right["code edit"] + right["code edit"][:1],
        "code edit": right["chat, asked again"][:3],
    }
    predictions = {"right": right, "wrong": wrong}
    runs: dict[tuple[str, int], list[Run]] = {
        (k, c): [] for k in prompts for c in range(len(CONFIGS))
    }
    with torch.inference_mode():
        for round_ in range(args.runs + 1):  # round 0 warms up and is dropped
            for kind, kind_prompts in prompts.items():
                for index, config_ in enumerate(CONFIGS):
                    which = config_[2]
                    chosen = (
                        [()] * len(kind_prompts) if which == "none" else predictions[which][kind]
                    )
                    run = run_requests(engine, kind_prompts, chosen, config_, args.max_tokens)
                    if round_:
                        runs[(kind, index)].append(run)
    rows = []
    for kind in prompts:
        base = runs[(kind, 0)]
        expected = [c.token_ids for c in base[-1].completions]
        for index, (label, method, which, _) in enumerate(CONFIGS):
            results = runs[(kind, index)]
            speed = statistics.median(r.tokens_per_second for r in results)
            ratio = statistics.median(
                r.tokens_per_second / b.tokens_per_second
                for r, b in zip(results, base, strict=True)
            )
            last = results[-1].completions
            steps = sum(c.spec.verify_steps for c in last)
            accepted = sum(c.spec.accepted for c in last)
            drafted = sum(c.spec.drafted for c in last)
            rows.append(
                [
                    kind,
                    label,
                    which if method != "none" else "",
                    f"{speed:.1f}",
                    f"{ratio:.2f}x",
                    f"{(accepted + steps) / steps:.2f}" if method != "none" and steps else "",
                    f"{drafted / steps:.2f}" if method != "none" and steps else "",
                    "yes" if [c.token_ids for c in last] == expected else "no",
                ]
            )
    body = "\n\n".join(
        [
            "## Predicted outputs",
            "`python -m tests.benchmarks.bench_prediction`",
            f"Machine: {machine_line()}. Bundled SmolLM2-135M-Instruct, bf16, greedy, chat "
            f"template, up to {args.max_tokens} new tokens, single stream, the engine as "
            "`outrider serve` builds it (adaptive k up to 4 unless the row says 16; EAGLE with "
            f"prompt lookup), medians of {args.runs} interleaved rounds. `chat, asked again`: "
            "four held-out chat prompts, each predicted by its own first answer (a client "
            "regenerating, or checking a cached answer); `code edit`: bench_spec's three code "
            "edits, each predicted by the code as sent (the answer is that code with an edit, "
            "after a line or two of prose; the code is in the prompt too, so prompt lookup "
            "finds it without the prediction). `wrong`: the other kind's prediction. `vs none`: "
            "tokens/s against no speculation, the median of per-round ratios. `same text`: the "
            "answers are those without speculation (greedy bf16 on our kernels is "
            "deterministic here; verification keeps them so whatever the prediction).",
            table(
                [
                    "requests",
                    "drafter",
                    "prediction",
                    "tokens/s",
                    "vs none",
                    "mean acceptance length",
                    "drafts/step",
                    "same text",
                ],
                rows,
            ),
        ]
    )
    print(body)
    write_section("bench_prediction", body, args.output)


if __name__ == "__main__":
    main()
