"""The engine's host work per decode step, with the model call removed.

`python -m tests.benchmarks.bench_host` fills an engine with 16, 64 and 256 decoding sequences
(the bundled model's tokenizer, plain decoding, as served) and times its steps with the runner a
GPU decodes with (`GraphRunner`: inputs staged into persistent buffers, padded to a captured
batch size; an 8k context) minus its model call: what is left is the step's host work
(scheduling, inputs, sampling and verification, committing tokens, outputs). The engine runs as
an `EngineLoop` runs it, whose callers make the outputs' text off its thread; that is timed
apart.
Greedy, and sampled with temperature, top-p and penalties. The logits are the bundled model's
where it answers held-out chat questions (what a served step samples from), each row narrowed
to its `--vocab` largest (1,024): the math over a whole vocabulary (argmax, softmax, top-p:
3.5 ms for a greedy step of 256 rows of the bundled model's 49,152 on the 2-core VM) is the
device's on a GPU, and `--vocab 49152` puts it back. Prints a table and the CPU's top-p at the
whole vocabulary (bench_host_sampling.py), writes its section of docs/benchmarks.md, and ends
with one JSON line: `{"greedy": {"16": {"us_per_seq": ...}, ...}, "sampled": {...}}`. On a GPU
the same work runs between the device's forwards; this measures it on the CPU alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kernels.attention_uniform import select_uniform_backend
from tests.benchmarks.bench_host_sampling import top_p_section
from tests.benchmarks.report import DEFAULT_REPORT, machine_line, table, write_section
from tests.factories import tiny_model
from tests.model.helpers import all_logits
from workers.eagle.prompts import HELD_OUT
from workers.engine import factory
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.factory import LoadedEngine
from workers.engine.graph_runner import GraphRunner
from workers.engine.llm_engine import LLMEngine
from workers.engine.output_text import OutputText
from workers.engine.sampler import Sampler
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_buffers import UniformShape
from workers.kv_cache import PagedKVCache
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

PROMPT_TOKENS = 16
ASYNC = "greedy, async scheduling"  # the row of an engine launching each step ahead
SIZES = (16, 64, 256)
MODES = {
    "greedy": SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(
        max_tokens=4000,
        temperature=0.8,
        top_p=0.95,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        ignore_eos=True,
        seed=None,
    ),
}


def answer_rows(answer_tokens: int = 64) -> tuple[torch.Tensor, LoadedEngine]:
    """The bundled model's logits where it answers held-out chat prompts (bf16 over the GGUF's
    blocks, greedy, `answer_tokens` a prompt; `[rows, vocab]` fp32), and its engine: the
    distributions a served step samples from, a few likely tokens and a long tail (top-p 0.95
    at temperature 0.8 keeps 3 tokens in the median row, 29 at the 90th percentile)."""
    spec = factory.ModelSpec(dtype="bfloat16", quantization="auto")
    loaded = factory.build_engine(spec, EngineConfig(spec=SpecConfig(method="none")), False)
    greedy = SamplingParams(max_tokens=answer_tokens, temperature=0.0)
    rows = []
    for prompt in chat_prompts(loaded.tokenizer, 4):
        answer = loaded.engine.generate([prompt], greedy)[0].token_ids
        logits = all_logits(loaded.engine.runner.model, prompt + answer)
        rows.append(logits[len(prompt) - 1 : -1].float())
    return torch.cat(rows), loaded


def chat_prompts(
    tokenizer: Tokenizer, count: int, questions: Sequence[str] = HELD_OUT["chat"]
) -> list[list[int]]:
    """`count` of the questions (the held-out chat ones) under the chat template, cycled."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[i % len(questions)]}]
            ),
            add_special_tokens=False,
        )
        for i in range(count)
    ]


def narrowed(rows: torch.Tensor, vocab: int) -> torch.Tensor:  # [rows, vocab]
    """Each row's `vocab` largest logits, in an order of its own (so that sequences fed the
    rows in turn have argmaxes of their own)."""
    largest = rows.topk(vocab, dim=-1).values
    shuffle = torch.rand(largest.shape, generator=torch.Generator().manual_seed(0)).argsort(-1)
    return largest.gather(1, shuffle)


class NullRunner(GraphRunner):
    """The runner a GPU serves decode steps with (`GraphRunner`: inputs staged into its
    persistent buffers, padded to a captured batch size), with the model call removed: its
    logits are `answer_rows`, narrowed, a window of them a step. Prefill steps run the
    (one-layer) model eagerly, untimed."""

    def __init__(self, model: TransformerLM, config: EngineConfig, logits: torch.Tensor) -> None:
        shape = model.config
        cache = PagedKVCache(shape, config.kv_blocks + 1, config.block_size, torch.float32)
        attention = select_uniform_backend(
            model.device, model.dtype, shape.head_dim, shape.num_heads // shape.num_kv_heads, 1
        )
        super().__init__(
            model,
            cache,
            attention=attention,
            max_num_seqs=config.max_num_seqs,
            max_width=1,
            max_graph_tokens=config.max_num_batched_tokens,
            scratch_block=config.kv_blocks,
            max_model_len=config.max_model_len,
        )
        # Every window of max_rows consecutive rows of `logits`, repeated: a step's logits are
        # the next window (a view), so each sequence meets another distribution each step.
        self._windows = logits[torch.arange(self.max_rows + len(logits)) % len(logits)]
        self._step = 0

    def _run(self, shape: UniformShape) -> None:
        """No forward: the next window of logits is the step's."""
        start = self._step % (len(self._windows) - self.max_rows)
        self._logits = self._windows[start : start + self.max_rows]
        self._step += 1


def build_engine(
    tokenizer: Any,
    logits: torch.Tensor,
    num_seqs: int,
    prompt_tokens: int = PROMPT_TOKENS,
    async_scheduling: bool = False,
) -> LLMEngine:
    """A plain-decoding engine for `num_seqs` sequences of `prompt_tokens`-token prompts over
    a null runner whose logits are `logits`' rows (`async_scheduling`: launching each step
    ahead of the last one's commit, workers/engine/overlap.py)."""
    model = tiny_model(0, vocab_size=logits.shape[1], max_position_embeddings=8192, num_layers=1)
    config = EngineConfig(
        max_model_len=8192,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=min(max(512, num_seqs * prompt_tokens), 16384),
        # Room for the prompts and every token the prefill and the timed steps add.
        num_kv_blocks=num_seqs * -(-(prompt_tokens + 256) // 16),
        async_scheduling=async_scheduling,
        spec=SpecConfig(method="none", adaptive=False),
    )
    engine = LLMEngine(
        model,
        config,
        tokenizer=tokenizer,
        eos_token_ids=(0,),
        runner=NullRunner(model, config, logits),
    )
    engine.makes_text = False  # as an `EngineLoop` runs it: its callers make the text
    return engine


class TimedSampler(Sampler):
    """The engine's sampler, its time kept: the sampling transform over the vocabulary (a
    top-p sort among it) and the draws, which a GPU's `DeviceSampler` runs on the device."""

    def __init__(self, inner: Sampler) -> None:
        self.inner, self.name, self.seconds = inner, inner.name, 0.0

    def device_for(self, logits: torch.Tensor) -> torch.device:
        return self.inner.device_for(logits)

    def sample(self, *args: Any) -> list[list[int]]:
        start = time.perf_counter()
        try:
            return self.inner.sample(*args)
        finally:
            self.seconds += time.perf_counter() - start


def time_steps(
    engine: LLMEngine,
    num_seqs: int,
    params: SamplingParams,
    steps: int,
    prompt_tokens: int = PROMPT_TOKENS,
) -> tuple[float, float, float]:
    """Median seconds of a decode step with `num_seqs` sequences, all decoding, of the same
    steps' time in the sampler, and of making their outputs' text as the callers of an
    `EngineLoop` do (`OutputText`, off the engine's thread)."""
    vocab = engine.runner.model.config.vocab_size
    texts = {}
    for i in range(num_seqs):
        prompt = [100 + (37 * i + j) % (vocab - 100) for j in range(prompt_tokens)]
        engine.add_request(f"r{i}", prompt, params)
        texts[f"r{i}"] = OutputText(engine.tokenizer, params, engine.eos_token_ids)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine._seqs.values()):
        failed = [out.error for out in engine.step() if out.error]  # the prefill, a token each
        if failed:
            raise RuntimeError(f"a request failed: {failed[0]}")
    if engine.scheduler.num_unfinished != num_seqs:
        raise RuntimeError(f"{engine.scheduler.num_unfinished} of {num_seqs} sequences run")
    for _ in range(3):
        engine.step()  # warm
    sampler = engine.sampler = TimedSampler(engine.sampler)
    times, sampling, text = [], [], []
    for _ in range(steps):
        sampler.seconds = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        taken = time.perf_counter()
        if any(texts[out.request_id].apply(out) for out in outputs):
            raise RuntimeError("no stop strings: nothing ends the text")
        text.append(time.perf_counter() - taken)
        times.append(taken - start)
        sampling.append(sampler.seconds)
        if len(outputs) != num_seqs or any(out.error for out in outputs):
            raise RuntimeError("every sequence decodes a token a step")
    engine.sampler = sampler.inner
    for i in range(num_seqs):
        engine.abort_request(f"r{i}")
    engine.take_outputs()
    return statistics.median(times), statistics.median(sampling), statistics.median(text)


def measure(
    tokenizer: Any, logits: torch.Tensor, sizes: Sequence[int], steps: int, long_prompts: int
) -> dict[str, dict[str, Any]]:
    """Every mode at every size; then, with `long_prompts`, greedy at the largest size with
    prompts that long (a block table of a hundred blocks and more a sequence)."""
    results: dict[str, dict[str, Any]] = {mode: {} for mode in MODES}
    results[ASYNC] = {}
    for n in sizes:
        engine = build_engine(tokenizer, logits, n)
        for mode, params in MODES.items():
            results[mode][str(n)] = _row(n, *time_steps(engine, n, params, steps))
        engine = build_engine(tokenizer, logits, n, async_scheduling=True)
        results[ASYNC][str(n)] = _row(n, *time_steps(engine, n, MODES["greedy"], steps))
    if long_prompts:
        n = sizes[-1]
        engine = build_engine(tokenizer, logits, n, long_prompts)
        timed = time_steps(engine, n, MODES["greedy"], steps, long_prompts)
        results[f"greedy, {long_prompts}-token prompts"] = {str(n): _row(n, *timed)}
    return results


def _row(num_seqs: int, seconds: float, sampling: float, text: float) -> dict[str, float]:
    return {
        "step_ms": round(seconds * 1000, 3),
        "us_per_seq": round(seconds / num_seqs * 1e6, 2),
        "sampler_ms": round(sampling * 1000, 3),
        "us_per_seq_beside_sampler": round((seconds - sampling) / num_seqs * 1e6, 2),
        "text_us_per_seq": round(text / num_seqs * 1e6, 2),
    }


def render(results: dict[str, dict[str, Any]], command: str, steps: int, vocab: int) -> str:
    rows = [
        [
            mode,
            n,
            f"{r['step_ms']:.2f}",
            f"{r['us_per_seq']:.1f}",
            f"{r['sampler_ms']:.2f}",
            f"{r['us_per_seq_beside_sampler']:.1f}",
            f"{r['text_us_per_seq']:.1f}",
        ]
        for mode, by_size in results.items()
        for n, r in by_size.items()
    ]
    header = ["decoding", "sequences", "step (ms)", "per sequence (us)", "sampler (ms)"]
    return (
        "## Host work per decode step (`python -m tests.benchmarks.bench_host`)\n\n"
        f"Command: `{command}`. {machine_line()}. A plain-decoding engine with the bundled "
        f"model's tokenizer, {PROMPT_TOKENS}-token prompts (where the row says no other), "
        "every sequence decoding, an 8k "
        "context, and the runner a GPU decodes with (`GraphRunner`: inputs staged into its "
        "persistent buffers, padded to a captured batch size) minus its model call: its logits "
        "are the bundled model's where it answers held-out chat questions, each row narrowed "
        f"to its {vocab:,} largest, the next rows each step. Median of {steps} steps. Sampled: "
        "temperature 0.8, top-p 0.95, frequency penalty 0.5, repetition penalty 1.1, no seed. "
        "The sampler column is the time in the host sampler (the sampling transform over the "
        "vocabulary, top-p among it, and the draws: a GPU's device sampler runs them on the "
        "device); the last column is the step's time beside it, per sequence. Async "
        "scheduling: each step launched before the last one's tokens are read "
        "(`EngineConfig.async_scheduling`), its host work timed the same way (on a GPU it "
        "runs beside the device's forward). The engine runs as an `EngineLoop` runs it: the "
        "outputs' text is made by the loop's callers, off its thread "
        "(workers/engine/output_text.py); the last column is that work, timed apart.\n\n"
        + table(
            [
                *header,
                "beside the sampler (us per sequence)",
                "text, in the callers (us per sequence)",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps a size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 and 64 sequences, 3 steps")
    parser.add_argument("--vocab", type=int, default=1024, help="the logits' width")
    parser.add_argument(
        "--long-prompts", type=int, default=2000, help="greedy's extra row (0: none)"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_REPORT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, steps = ((16, 64), 3) if args.quick else (SIZES, args.steps)
    long_prompts = 0 if args.quick else args.long_prompts
    rows, loaded = answer_rows()
    results = measure(loaded.tokenizer, narrowed(rows, args.vocab), sizes, steps, long_prompts)
    command = "python -m tests.benchmarks.bench_host" + (" --quick" if args.quick else "")
    if args.vocab != 1024:
        command += f" --vocab {args.vocab}"
    if long_prompts != 2000 and not args.quick:
        command += f" --long-prompts {long_prompts}"
    text = render(results, command, steps, args.vocab) + "\n\n"
    text += top_p_section(rows, loaded, chat_prompts(loaded.tokenizer, 32), args.quick)
    print(text)
    write_section("bench_host", text, args.output)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
