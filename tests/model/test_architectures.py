"""Tiny random llama and qwen2 models: our forward against transformers' own classes."""

from __future__ import annotations

import pytest
import torch

from tests.factories import random_hf_weights, tiny_config
from tests.model.helpers import all_logits
from workers.model.transformer import TransformerLM

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_matches_transformers(arch: str) -> None:
    config = tiny_config(arch)
    weights = random_hf_weights(config, seed=1)
    ours = TransformerLM(config)
    ours.load_hf_weights(weights)
    ours.eval()

    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        hf.tie_weights()

    ids = torch.randint(
        0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(all_logits(ours, ids), theirs, rtol=1e-4, atol=1e-4)


def test_weights_that_do_not_fit_the_config_are_rejected() -> None:
    config = tiny_config("qwen2")
    weights = random_hf_weights(config)
    del weights["model.layers.0.self_attn.q_proj.bias"]
    with pytest.raises(ValueError, match="missing"):
        TransformerLM(config).load_hf_weights(weights)
