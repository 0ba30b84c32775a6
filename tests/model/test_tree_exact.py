"""Draft trees are lossless on the bundled model: EAGLE's trees (workers/drafting/eagle_tree.py)
verified in one forward commit exactly what plain decoding does, in every CPU format, and a
seeded sampled request draws the same text each time."""

from __future__ import annotations

import pytest

from tests.model.helpers import plain_tokens, run_staggered
from workers.drafting.eagle import EagleDrafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

pytestmark = pytest.mark.slow

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "Summarize: cats sleep a lot. Cats sleep most of the day because",
]
# Every tree whole: verifying more nodes costs nothing at these prices, so none is cut.
TREES = SpecConfig(
    method="eagle",
    num_speculative_tokens=4,
    adaptive=False,
    disable_batch_size=64,
    tree_nodes=16,
    verify_costs=(1.0,) * 32,
)


def tree_engine(model: TransformerLM, eos: tuple[int, ...]) -> tuple[LLMEngine, EagleDrafter]:
    drafter = EagleDrafter(load_head(BUNDLED_HEAD), model, num_blocks=512)
    engine = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=TREES),
        eos_token_ids=eos,
        drafters={"eagle": drafter},
    )
    return engine, drafter


def test_greedy_trees_identical_to_plain_decoding(cpu_format_model, checkpoint) -> None:  # type: ignore[no-untyped-def]
    eos = checkpoint.config.eos_token_ids
    prompts = [checkpoint.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=32, temperature=0)
    expected = plain_tokens(cpu_format_model, eos, prompts, params)
    engine, drafter = tree_engine(cpu_format_model, eos)
    assert run_staggered(engine, prompts, params, RequestSpec(method="eagle")) == expected
    assert drafter.trees.drafted > 0 and engine.stats.accepted > 0
    # More tokens a step than the head's top token alone gives would be a measurement
    # (bench_eagle); here only that every block came back.
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


def test_seeded_sampled_trees_draw_the_same_text(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    eos = checkpoint.config.eos_token_ids
    prompts = [checkpoint.tokenizer.encode(t) for t in TEXTS[1:]]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        engine, drafter = tree_engine(model_fp32, eos)
        runs.append(run_staggered(engine, prompts, params, RequestSpec(method="eagle")))
        assert drafter.trees.drafted > 0
    assert runs[0] == runs[1] and all(len(r) == 24 or r[-1] in eos for r in runs[0])
