"""Our forward of the bundled model against transformers reading the same GGUF (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import all_logits
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Summarize: The mitochondria is the powerhouse of the cell. It produces energy.",
]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model_fp32, hf_model, checkpoint, prompt: str) -> None:  # type: ignore[no-untyped-def]
    ids = checkpoint.tokenizer.encode(prompt)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    ours = all_logits(model_fp32, ids)
    assert ours.shape == theirs.shape
    assert relative_error(ours, theirs) < 1e-4


def test_hidden_states_match_transformers(model_fp32, hf_model, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from tests.model.helpers import make_runner
    from workers.engine.model_runner import SeqForward
    from workers.kv_cache import BlockTable

    ids = checkpoint.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    runner, alloc = make_runner(model_fp32)
    table = BlockTable(alloc, runner.block_size)
    table.prepare_write(0, len(ids))
    out = runner.forward(
        [SeqForward(ids, 0, table.block_ids)], hidden_layers=(2, 14, 27), return_final_hidden=True
    )
    # transformers' hidden_states[i + 1] is the output of layer i; the last one is after the norm.
    for layer in (2, 14, 27):
        assert relative_error(out.hidden_of(layer, 0), theirs[layer + 1][0]) < 1e-4
    assert out.output.final_hidden is not None
    assert relative_error(out.output.final_hidden, theirs[-1][0]) < 1e-4


@pytest.mark.parametrize("prompt", PROMPTS[1:3])
def test_greedy_64_tokens_identical_to_transformers_generate(
    model_fp32,
    hf_model,
    checkpoint,
    prompt: str,  # type: ignore[no-untyped-def]
) -> None:
    ids = checkpoint.tokenizer.encode(prompt)
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
    engine = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=512
    )
    ours = engine.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert len(theirs) == 64
    assert ours.token_ids == theirs
    assert ours.finish_reason == "length"
