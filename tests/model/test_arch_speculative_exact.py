"""Speculation over each architecture we added to llama's (Llama 3 rope scaling, Qwen3's
per-head norms, Mistral's window) equals plain decoding bit for bit, in bf16 over a GGUF's Q8_0
blocks (what a CPU serves) and in fp32, as the bundled llama's suites hold it
(tests/model/test_speculative_exact.py, test_quant_exact.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from kernels.linear import row_independent_rows
from tests.model.helpers import plain_tokens, run_staggered
from tests.model.test_architectures import read_gguf
from tests.model_files import ARCH_CASES, SMALL_VOCAB, model_weights, write_gguf
from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import build_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        row_independent_rows() < 4 * 5, reason="needs our native kernels for every row"
    ),
]

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SPEC = SpecConfig(num_speculative_tokens=4, adaptive=False, disable_batch_size=64)
FORMATS = {"bf16-blocks": (torch.bfloat16, True), "fp32": (torch.float32, False)}
PROMPTS = [
    torch.randint(0, SMALL_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (9, 23, 40, 61)
]


@pytest.fixture(scope="module", params=["llama3.1", "qwen3", "mistral"])
def gguf_file(request, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    config = ARCH_CASES[request.param]
    path = tmp_path_factory.mktemp("arch") / f"{request.param}.gguf"
    write_gguf(config, model_weights(config, seed=3), path, gguf.GGMLQuantizationType.Q8_0, False)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_speculation_equals_plain_decoding(gguf_file: Path, fmt: str, method: str) -> None:
    dtype, blocks = FORMATS[fmt]
    checkpoint = read_gguf(gguf_file, keep_quantized=blocks)
    target = build_model(checkpoint, dtype=dtype)
    assert bool(target.quantized_kinds()) == blocks
    want = plain_tokens(target, (), PROMPTS, GREEDY)
    # ngram's drafts are mostly rejected here; the target drafting for itself has every one
    # accepted: both ends of verification.
    drafter: Drafter = (
        NgramDrafter(NgramConfig(1, 4))
        if method == "ngram"
        else DraftModelDrafter(build_model(checkpoint, dtype=dtype), 256)
    )
    engine = LLMEngine(
        target, EngineConfig(max_model_len=256, spec=SPEC), drafters={drafter.method: drafter}
    )
    got = run_staggered(engine, PROMPTS, GREEDY, RequestSpec(method=drafter.method))
    assert got == want
    assert engine.stats.drafted > 0
    if method == "self_draft":
        assert engine.stats.accepted > engine.stats.drafted // 2
