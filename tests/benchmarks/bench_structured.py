"""What structured output costs and how it speculates, on the bundled model.

    python -m tests.benchmarks.bench_structured [--runs 3] [--max-tokens 128]

Single stream, bf16, greedy, chat template, the engine as `outrider serve` builds it (adaptive
k, EAGLE's drafts ended where the head doubts them). Four extraction tasks, each asked once
with its JSON schema as the request's grammar and once without (the same prompt, which asks for
JSON): tokens/s, acceptance, whether the answers hold to the schema, and the host time the
grammar masks take per step. Writes the `bench_structured` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import torch

from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import Completion, LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarState, compile_grammar
from workers.model.tokenizer import Tokenizer

K = 4
STRING = {"type": "string"}
TASKS: list[tuple[str, dict[str, Any]]] = [
    (
        "Maria Lopez is 34 and works as a nurse in Madrid. She speaks Spanish and English. "
        "Give her name, age, job, city and languages as JSON.",
        {
            "type": "object",
            "properties": {
                "name": STRING,
                "age": {"type": "integer"},
                "job": STRING,
                "city": STRING,
                "languages": {"type": "array", "items": STRING},
            },
            "required": ["name", "age", "job", "city", "languages"],
            "additionalProperties": False,
        },
    ),
    (
        "List three fruits with their colour and a price in dollars, as JSON.",
        {
            "type": "object",
            "properties": {
                "fruits": {
                    "type": "array",
                    "minItems": 3,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": STRING,
                            "colour": STRING,
                            "price": {"type": "number"},
                        },
                        "required": ["name", "colour", "price"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    (
        "Make a calendar entry as JSON for a team meeting on 2025-03-10 at 10:00 in room 4 "
        "with Ann and Raj.",
        {
            "type": "object",
            "properties": {
                "title": STRING,
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                "room": {"type": "integer"},
                "attendees": {"type": "array", "items": STRING},
            },
            "required": ["title", "date", "time", "room", "attendees"],
            "additionalProperties": False,
        },
    ),
    (
        "Review: 'The battery dies in an hour and the screen scratches easily.' Give its "
        "sentiment (positive, negative or neutral) and a short reason, as JSON.",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "reason": STRING,
            },
            "required": ["sentiment", "reason"],
            "additionalProperties": False,
        },
    ),
]
DRAFTERS = [("none", "none"), ("ngram", "ngram"), ("eagle", "eagle")]


@dataclass(slots=True)
class Run:
    seconds: float = 0.0
    completions: list[Completion] = field(default_factory=list)
    mask_seconds: float = 0.0
    mask_calls: int = 0
    mask_rows: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@contextlib.contextmanager
def timed_masks(run: Run) -> Iterator[None]:
    """Count the time `GrammarState.mask` takes (the grammar's whole share of a step)."""
    original = GrammarState.mask

    def mask(self: GrammarState, logits: torch.Tensor, draft_ids: Any = ()) -> torch.Tensor:
        start = time.perf_counter()
        out = original(self, logits, draft_ids)
        run.mask_seconds += time.perf_counter() - start
        run.mask_calls += 1
        run.mask_rows += logits.shape[0]
        return out

    with mock.patch.object(GrammarState, "mask", mask):
        yield


def run_tasks(
    engine: LLMEngine, prompts: list[list[int]], method: str, schema: bool, max_tokens: int
) -> Run:
    """Each task alone (single stream), one after the other."""
    spec = RequestSpec(enabled=method != "none", method=None if method == "none" else method)
    run = Run()
    with timed_masks(run):
        for prompt, (_, task_schema) in zip(prompts, TASKS, strict=True):
            structured = compile_grammar("json", task_schema) if schema else None
            params = SamplingParams(max_tokens=max_tokens, temperature=0, structured=structured)
            start = time.perf_counter()
            run.completions += engine.generate([prompt], params, spec)
            run.seconds += time.perf_counter() - start
    return run


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def chat(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.max_tokens = 1, 8
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        max_model_len=1024, spec=SpecConfig(method="eagle", num_speculative_tokens=K)
    )
    loaded = build_engine(ModelSpec(dtype="bfloat16"), config, progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    prompts = [chat(tokenizer, text) for text, _ in TASKS]
    configs = [(label, method, schema) for label, method in DRAFTERS for schema in (False, True)]
    runs: dict[tuple[str, str, bool], list[Run]] = {c: [] for c in configs}
    with torch.inference_mode():
        for round_ in range(args.runs + 1):  # round 0 warms up and is dropped
            for config_ in configs:
                run = run_tasks(engine, prompts, config_[1], config_[2], args.max_tokens)
                if round_:
                    runs[config_].append(run)
    rows = []
    for label, method, schema in configs:
        results = runs[(label, method, schema)]
        base = runs[("none", "none", schema)]
        speed = statistics.median(r.tokens / r.seconds for r in results)
        ratio = statistics.median(
            (r.tokens / r.seconds) / (b.tokens / b.seconds)
            for r, b in zip(results, base, strict=True)
        )
        last = results[-1].completions
        steps = sum(c.spec.verify_steps for c in last)
        accepted = sum(c.spec.accepted for c in last)
        held = sum(valid(c.text, s) for c, (_, s) in zip(last, TASKS, strict=True))
        mask_ms = statistics.median(r.mask_seconds / max(r.mask_calls, 1) * 1e3 for r in results)
        share = statistics.median(r.mask_seconds / r.seconds for r in results)
        rows.append(
            [
                label,
                "schema" if schema else "none (the prompt asks for JSON)",
                f"{speed:.1f}",
                f"{ratio:.2f}x",
                f"{(accepted + steps) / steps:.2f}" if method != "none" and steps else "",
                f"{results[-1].tokens / len(TASKS):.0f}",
                f"{held}/{len(TASKS)}",
                f"{mask_ms:.2f} ms, {share:.1%}" if schema else "",
            ]
        )
    print(json.dumps([c.text for c in runs[("eagle", "eagle", True)][-1].completions], indent=1))
    body = "\n\n".join(
        [
            "## Structured output",
            "`python -m tests.benchmarks.bench_structured`",
            f"Machine: {machine_line()}. Bundled SmolLM2-135M-Instruct, bf16, greedy, "
            f"chat template, up to {args.max_tokens} new tokens, single stream, the engine as "
            "`outrider serve` builds it (adaptive k up to 4; EAGLE's drafts end where the head "
            f"doubts them), medians of {args.runs} interleaved rounds. Four extraction tasks "
            "(tests/benchmarks/bench_structured.py `TASKS`: a person, three fruits, a calendar "
            "entry, a review's sentiment), each prompt asking for JSON; `grammar`: the task's "
            "JSON schema as the request's `response_format`, or none. `vs none`: tokens/s "
            "against no speculation with the same grammar, the median of per-round ratios. "
            "`answers that hold to the schema`: parsed and validated (jsonschema), last round. "
            "`grammar masks`: the host time of one sequence's masks in one step (llguidance's "
            "bitmask for each verified row, with the grammar advanced over the drafts and rolled "
            "back, unpacked and applied to the logits), and their share of the run.",
            table(
                [
                    "drafter",
                    "grammar",
                    "tokens/s",
                    "vs none",
                    "mean acceptance length",
                    "tokens per answer",
                    "answers that hold to the schema",
                    "grammar masks per step, share of time",
                ],
                rows,
            ),
        ]
    )
    print(body)
    write_section("bench_structured", body, args.output)


if __name__ == "__main__":
    main()
