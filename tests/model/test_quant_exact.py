"""Speculative decoding over a quantized target is lossless: with the bundled GGUF's Q4_1/Q8_0
blocks kept (what a CPU deployment runs by default), greedy output is identical to the same
quantized target decoding alone, for every drafter and batch size.

In bf16 on our native kernels, where every op computes a token's row from its own inputs alone
(tests/model/test_speculative_exact.py has the float model's case, bf16 and fp32): the quantized
projection rounds each row to int8 per block, so a last-bit difference between a batched and a
lone forward anywhere before it would move a rounding and then a near-tie between two tokens."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import row_independent_rows
from tests.model.helpers import plain_tokens, run_staggered
from tests.model.test_speculative_exact import GREEDY, SPEC, prompt_texts
from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Continuation
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats
from workers.model.loader import build_model, truncate_layers
from workers.model.transformer import QuantizedLinear

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        row_independent_rows() < 16 * (1 + SPEC.num_speculative_tokens),
        reason="needs our native kernels for every row of a verification",
    ),
]


@pytest.fixture(scope="module")
def target(quantized_checkpoint):  # type: ignore[no-untyped-def]
    return build_model(quantized_checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompt_ids(checkpoint) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [checkpoint.tokenizer.encode(t) for t in prompt_texts()]


@pytest.fixture(scope="module")
def expected(target, checkpoint, prompt_ids) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return plain_tokens(target, checkpoint.config.eos_token_ids, prompt_ids, GREEDY)


def drafter_for(method: str, target, quantized_checkpoint) -> Drafter:  # type: ignore[no-untyped-def]
    if method == "ngram":
        return NgramDrafter(NgramConfig(1, 4))
    if method == "suffix":
        return SuffixDrafter(NgramConfig(1, 4))
    if method == "eagle":  # the head reads the target's quantized embedding and LM head rows
        return EagleDrafter(load_head(BUNDLED_HEAD), target, num_blocks=1024)
    # The target's first layers, in their blocks too: the draft model path over quantized weights.
    draft = build_model(truncate_layers(quantized_checkpoint, 8), dtype=torch.bfloat16)
    assert isinstance(draft.layers[0].mlp.down_proj, QuantizedLinear)
    return DraftModelDrafter(draft, num_blocks=1024)


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_greedy_identical_to_the_quantized_target_alone(
    method: str,
    batch: int,
    target,
    quantized_checkpoint,
    checkpoint,
    prompt_ids,
    expected,  # type: ignore[no-untyped-def]
) -> None:
    assert isinstance(target.layers[0].self_attn.qkv_proj, QuantizedLinear)
    drafter = drafter_for(method, target, quantized_checkpoint)
    engine = LLMEngine(
        target,
        EngineConfig(max_model_len=512, spec=SPEC),
        eos_token_ids=checkpoint.config.eos_token_ids,
        drafters={drafter.method: drafter},
    )
    got = run_staggered(engine, prompt_ids[:batch], GREEDY, RequestSpec(method=drafter.method))
    assert got == expected[:batch]
    assert engine.stats.drafted > 0
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


def test_a_requests_text_depends_on_neither_its_prefill_chunks_nor_the_prefix_cache(
    target,
    checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    """bf16 over the GGUF's blocks, what `outrider serve` runs: prompts sharing a preamble,
    prefilled whole and alone (SequentialEngine), in chunks of 24 tokens beside each other, or
    after the preamble's blocks are in the prefix cache, give the same greedy text (prefill
    attention is the decode kernel's, computing each token from its own query and keys)."""
    tok = checkpoint.tokenizer
    preamble = tok.encode("You are a careful assistant. Answer briefly and precisely. " * 3)
    prompts = [preamble + tok.encode(t) for t in prompt_texts()[:4]]
    eos = checkpoint.config.eos_token_ids
    want = plain_tokens(target, eos, prompts, GREEDY)
    for budget in (24, 512):
        config = EngineConfig(max_model_len=512, max_num_batched_tokens=budget)
        engine = LLMEngine(target, config, eos_token_ids=eos)
        off = RequestSpec(enabled=False)
        assert run_staggered(engine, prompts[:1], GREEDY, off) == want[:1]  # caches the preamble
        assert run_staggered(engine, prompts, GREEDY, off, gap=1) == want
        assert engine.scheduler.prefix_hit_tokens >= 4 * (len(preamble) // 16) * 16


def test_a_request_continued_on_another_engine_gives_the_text_of_one_run(
    target,
    checkpoint,
    prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    """bf16 over the GGUF's blocks: greedy requests cut after 30 tokens and continued on a fresh
    engine (prompt and output recomputed as one prefill, what the router does when a verifier
    dies mid-stream) give the tokens of one uninterrupted run."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    off = RequestSpec(enabled=False)

    def fresh() -> LLMEngine:
        config = EngineConfig(max_model_len=512)
        return LLMEngine(target, config, eos_token_ids=checkpoint.config.eos_token_ids)

    for prompt in prompt_ids[:4]:
        whole = fresh().generate([prompt], params, off)[0].token_ids
        moved = fresh()
        continuation = Continuation(tuple(whole[:30]), SpecStats())
        moved.add_request("r", prompt, params, off, continuation=continuation)
        rest: list[int] = []
        while moved.has_unfinished_requests():
            rest += [t for out in moved.step() for t in out.new_token_ids]
        assert whole[:30] + rest == whole
