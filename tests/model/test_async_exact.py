"""Async scheduling (workers/engine/overlap.py) on the bundled model, in every CPU format: plain
decode steps launched ahead of the last one's commit give the tokens plain decoding gives, with
n-gram speculation running its steps synchronously while the load lets it draft."""

from __future__ import annotations

import pytest

from tests.model.helpers import plain_tokens, run_staggered
from tests.model.test_tree_exact import TEXTS
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_async_steps_identical_to_plain_decoding(cpu_format_model, checkpoint) -> None:  # type: ignore[no-untyped-def]
    eos = checkpoint.config.eos_token_ids
    prompts = [checkpoint.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = plain_tokens(cpu_format_model, eos, prompts, params)
    # Two or more unfinished requests draft nothing: their steps go ahead; one alone drafts.
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=4, adaptive=False, disable_batch_size=2
    )
    config = EngineConfig(max_model_len=512, async_scheduling=True, spec=spec)
    drafters = {"ngram": NgramDrafter(NgramConfig(1, 3))}
    engine = LLMEngine(cpu_format_model, config, eos_token_ids=eos, drafters=drafters)
    # The first request decodes alone for a while (drafting), then the others join.
    got = run_staggered(engine, prompts, params, RequestSpec(method="ngram"), gap=10)
    assert got == expected
    assert engine.num_async_steps > 0 and engine.stats.drafted > 0
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks
