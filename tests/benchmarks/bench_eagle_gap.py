"""What EAGLE's head loses when speculation pauses: its acceptance after a gap.

    python -m tests.benchmarks.bench_eagle_gap [--gap 32] [--max-tokens 160]

While `disable_batch_size` or more requests are unfinished nobody drafts, and the engine sends
the drafters no hidden states (workers/engine/speculator.py `hidden_layers`: handing them over
costs more host time a step than a GPU step of a small model). When the load falls, an EAGLE
sequence's head starts its cache over from the features it gets next (workers/drafting/eagle.py
`observe_hidden`), without the context before the gap.

Each held-out chat and code prompt is answered twice by one engine (the bundled model, bf16 over
the GGUF's blocks, greedy, EAGLE's head alone at a fixed k = 4 with whole drafts): alone, and
beside `disable_batch_size` filler requests that keep it from drafting for its first `--gap`
steps. Both give the same tokens; the table compares the head's mean acceptance length at the
same positions, in the first 12 drafting steps after the gap and over the rest of the answer.
Writes the `bench_eagle_gap` section of docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
import statistics

from tests.benchmarks.bench_host import chat_prompts
from tests.benchmarks.report import bench_args, bench_parser, machine_line, table, write_section
from workers.eagle.prompts import HELD_OUT
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.factory import ModelSpec, build_engine
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StepReport
from workers.engine.sampling_params import SamplingParams

FIRST_STEPS = 12  # drafting steps right after the gap, where the head's context is shortest
FILLER = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


def answer(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, gap: int
) -> tuple[list[int], dict[int, int]]:
    """The request's tokens, and, by the position a verify step started at, the drafts it
    accepted (steps that drafted); with `gap`, beside fillers for its first `gap` steps."""
    rounds: list[tuple[int, int]] = []  # (drafted, accepted) of each of its verify steps

    def listen(report: StepReport) -> None:
        rounds.extend(
            (r.drafted, r.accepted)
            for r in report.rounds
            if r.request_id == "probe" and not r.prefill_tokens
        )

    fillers = [f"filler-{i}" for i in range(engine.config.spec.disable_batch_size)] if gap else []
    engine.step_listeners.append(listen)
    try:
        engine.add_request("probe", prompt, params)
        for rid in fillers:
            engine.add_request(rid, [1, 2, 3, 4], FILLER)
        tokens: list[int] = []
        for step in itertools.count(1):
            done = False
            for out in engine.step():
                if out.request_id == "probe":
                    tokens += out.new_token_ids
                    done = out.finished
            if step == gap or done:
                for rid in fillers:
                    engine.abort_request(rid)
                engine.take_outputs()
                fillers = []
            if done:
                break
    finally:
        engine.step_listeners.remove(listen)
    accepted, position = {}, 0
    for drafted, taken in rounds:
        if drafted:
            accepted[position] = taken
        position += taken + 1
    return tokens, accepted


def compare(engine: LLMEngine, prompts: list[list[int]], gap: int, tokens: int) -> list[str]:
    """Mean acceptance lengths (continuous / after the gap) at the positions the gapped run
    drafted at, over the first steps and the rest, pooled over `prompts`."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    first: dict[str, list[int]] = {"alone": [], "gap": []}
    rest: dict[str, list[int]] = {"alone": [], "gap": []}
    for prompt in prompts:
        alone_tokens, alone = answer(engine, prompt, params, 0)
        gap_tokens, gapped = answer(engine, prompt, params, gap)
        if alone_tokens != gap_tokens:
            raise RuntimeError("the gap changed the tokens: greedy output must not depend on it")
        resume = min(gapped, default=None)
        if resume is None:
            continue
        for run, accepted in (("alone", alone), ("gap", gapped)):
            taken = [a for position, a in sorted(accepted.items()) if position >= resume]
            first[run] += taken[:FIRST_STEPS]
            rest[run] += taken[FIRST_STEPS:]

    def mean(values: list[int]) -> str:
        return f"{statistics.mean(values) + 1:.2f}" if values else "-"

    return [mean(first["alone"]), mean(first["gap"]), mean(rest["alone"]), mean(rest["gap"])]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--gap", type=int, default=32, help="steps without drafting")
    parser.set_defaults(max_tokens=160)
    args = bench_args(parser)
    gap = 2 if args.quick else args.gap
    spec = SpecConfig(
        method="eagle", adaptive=False, eagle_prompt_lookup=False, min_draft_confidence=0.0
    )
    model = ModelSpec(dtype="bfloat16", quantization="auto")
    loaded = build_engine(model, EngineConfig(spec=spec), progress=False)
    kinds = ("chat", "code")
    rows: list[list[str]] = []
    for kind in kinds:
        questions = HELD_OUT[kind][:1] if args.quick else HELD_OUT[kind]
        prompts = chat_prompts(loaded.tokenizer, len(questions), questions)
        rows.append(
            [kind, str(len(prompts)), *compare(loaded.engine, prompts, gap, args.max_tokens)]
        )
    header = [
        "prompts",
        "count",
        f"first {FIRST_STEPS} drafting steps, no gap",
        f"first {FIRST_STEPS}, after the gap",
        "the rest, no gap",
        "the rest, after the gap",
    ]
    body = (
        "## EAGLE after a pause in speculation (`python -m tests.benchmarks.bench_eagle_gap`)\n\n"
        f"Machine: {machine_line()}. The bundled model, bf16 over the GGUF's blocks, greedy, up "
        f"to {args.max_tokens} tokens; EAGLE's head alone at a fixed k = 4, whole drafts. Each "
        "held-out prompt answered alone, and beside filler requests that keep anyone from "
        f"drafting for its first {gap} steps (no hidden states reach the head then: its cache "
        "starts over after the gap); the same tokens both ways. Mean acceptance length at the "
        "same positions from where the gapped answer drafts again.\n\n" + table(header, rows)
    )
    print(body)
    write_section("bench_eagle_gap", body, args.output)


if __name__ == "__main__":
    main()
