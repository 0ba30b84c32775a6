"""What structured output costs and how it speculates, on the bundled model.

    python -m tests.benchmarks.bench_structured [--runs 3] [--max-tokens 128]

Single stream, bf16, greedy, chat template, the engine as `outrider serve` builds it (adaptive
k, EAGLE's drafts ended where the head doubts them). Four extraction tasks, each asked three
ways: without a grammar (the prompt asks for JSON), with its JSON schema as the request's
grammar, and as a forced tool call whose parameters are the schema (the router's prompt, which
shows the tool, and its grammar for a named tool_choice). Tokens/s, acceptance, whether the
answers hold to the schema, and the host time the grammar masks take per step. Writes the
`bench_structured` section of docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import jsonschema
import torch

from router.tools import ToolCalling, call_grammar, read_answer, render_prompt
from tests.benchmarks.report import bench_args, bench_parser, machine_line, table, write_section
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarState, StructuredOutput, compile_grammar
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
MODES = ["none", "schema", "tool call"]


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


def tool(schema: dict[str, Any]) -> dict[str, Any]:
    """A task's schema as the parameters of the function its tool-call mode must call."""
    return {"name": "record", "description": "Record the answer", "parameters": schema}


def requests(tokenizer: Tokenizer, mode: str) -> list[tuple[list[int], StructuredOutput | None]]:
    """Each task's prompt and grammar in one of MODES."""
    out: list[tuple[list[int], StructuredOutput | None]] = []
    for text, schema in TASKS:
        messages = [{"role": "user", "content": text}]
        if mode == "tool call":
            tools = [{"type": "function", "function": tool(schema)}]
            prompt = tokenizer.encode(render_prompt(tokenizer, messages, tools))
            out.append((prompt, call_grammar([tool(schema)], "record", False, tokenizer)))
        else:
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
            out.append((prompt, compile_grammar("json", schema) if mode == "schema" else None))
    return out


def run_tasks(
    engine: LLMEngine,
    tasks: list[tuple[list[int], StructuredOutput | None]],
    method: str,
    max_tokens: int,
) -> Run:
    """Each task alone (single stream), one after the other."""
    spec = RequestSpec(enabled=method != "none", method=None if method == "none" else method)
    run = Run()
    with timed_masks(run):
        for prompt, structured in tasks:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, structured=structured)
            start = time.perf_counter()
            run.completions += engine.generate([prompt], params, spec)
            run.seconds += time.perf_counter() - start
    return run


def valid(text: str, schema: dict[str, Any], mode: str) -> bool:
    """Whether an answer holds to its task's schema (a tool call's, its arguments)."""
    try:
        if mode == "tool call":
            _, calls = read_answer(ToolCalling(("record",), named=True), text)
            if len(calls) != 1:
                return False
            text = calls[0]["function"]["arguments"]
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    args = bench_args(bench_parser(__doc__))
    config = EngineConfig(
        max_model_len=1024, spec=SpecConfig(method="eagle", num_speculative_tokens=K)
    )
    loaded = build_engine(ModelSpec(dtype="bfloat16"), config, progress=False)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    tasks = {mode: requests(tokenizer, mode) for mode in MODES}
    configs = [(label, method, mode) for label, method in DRAFTERS for mode in MODES]
    runs: dict[tuple[str, str, str], list[Run]] = {c: [] for c in configs}
    with torch.inference_mode():
        for round_ in range(args.runs + 1):  # round 0 warms up and is dropped
            for config_ in configs:
                run = run_tasks(engine, tasks[config_[2]], config_[1], args.max_tokens)
                if round_:
                    runs[config_].append(run)
    rows = []
    for label, method, mode in configs:
        results = runs[(label, method, mode)]
        base = runs[("none", "none", mode)]
        speed = statistics.median(r.tokens / r.seconds for r in results)
        ratio = statistics.median(
            (r.tokens / r.seconds) / (b.tokens / b.seconds)
            for r, b in zip(results, base, strict=True)
        )
        last = results[-1].completions
        steps = sum(c.spec.verify_steps for c in last)
        accepted = sum(c.spec.accepted for c in last)
        held = sum(valid(c.text, s, mode) for c, (_, s) in zip(last, TASKS, strict=True))
        mask_ms = statistics.median(r.mask_seconds / max(r.mask_calls, 1) * 1e3 for r in results)
        share = statistics.median(r.mask_seconds / r.seconds for r in results)
        rows.append(
            [
                label,
                mode if mode != "none" else "none (the prompt asks for JSON)",
                f"{speed:.1f}",
                f"{ratio:.2f}x",
                f"{(accepted + steps) / steps:.2f}" if method != "none" and steps else "",
                f"{results[-1].tokens / len(TASKS):.0f}",
                f"{held}/{len(TASKS)}",
                f"{mask_ms:.2f} ms, {share:.1%}" if mode != "none" else "",
            ]
        )
    for mode in MODES[1:]:
        answers = runs[("eagle", "eagle", mode)][-1].completions
        print(json.dumps([c.text for c in answers], indent=1))
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
            "JSON schema as the request's `response_format`; `tool call`: the request as the "
            "router builds it for a named `tool_choice` whose function takes the schema as its "
            "parameters (the prompt shows the tool; the grammar holds the answer to one call); "
            "or none. `vs none`: tokens/s "
            "against no speculation with the same grammar, the median of per-round ratios. "
            "`answers that hold to the schema`: parsed (a tool call's arguments) and validated "
            "(jsonschema), last round. "
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
