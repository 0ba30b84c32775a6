"""Rotary embedding against the complex-number formulation; config validation."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.rotary import RopeScaling, apply_rotary, rope_cos_sin, rope_inv_freq
from tests.factories import tiny_config
from workers.model.config import ModelConfig


def test_rotary_matches_complex_rotation() -> None:
    head_dim, theta = 8, 10000.0
    cos, sin = rope_cos_sin(head_dim, 64, theta)
    positions = torch.tensor([0, 5, 63])
    x = torch.randn(3, 2, head_dim)
    out = apply_rotary(x, cos[positions], sin[positions])
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(half).float() * 2 / head_dim)
    angle = positions[:, None].float() * freqs[None, :]  # [3, half]
    z = (
        torch.complex(x[..., :half], x[..., half:])
        * torch.polar(torch.ones_like(angle), angle)[:, None]
    )
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_config_validation_errors() -> None:
    with pytest.raises(ValueError, match="unsupported architecture"):
        tiny_config(architecture="gpt2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="hidden_size must be positive"):
        tiny_config(hidden_size=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_hf_config_round_trip(arch: str) -> None:
    config = tiny_config(arch)
    again = ModelConfig.from_hf_config(config.to_hf_config())
    assert again == config


def test_hf_config_reads_both_spellings_of_rope_scaling() -> None:
    """transformers 5's `rope_parameters` (theta inside) and 4's `rope_scaling` (`type`);
    dynamic NTK is plain rotary within the model's context, which is all that is served."""
    cfg = tiny_config().to_hf_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert ModelConfig.from_hf_config(cfg).rope_theta == 500.0
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}
    yarn = ModelConfig.from_hf_config(cfg).rope_scaling
    assert yarn is not None and yarn.kind == "yarn"
    assert yarn.original_max_positions == cfg["max_position_embeddings"]
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 500.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf_config(cfg).rope_scaling == RopeScaling("linear", factor=2.0)
    cfg["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    assert ModelConfig.from_hf_config(cfg).rope_scaling is None


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
    ],
)
def test_scaled_frequencies_match_transformers(rope: dict[str, object]) -> None:
    """Our inverse frequencies and attention factor against transformers' own rope functions,
    the reference for each kind."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config(head_dim=32, num_heads=4, hidden_size=128).to_hf_config()
    cfg["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    config = ModelConfig.from_hf_config(cfg)
    hf_config = transformers.AutoConfig.for_model(**cfg)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](hf_config, None)
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=0)
    assert config.rope_scaling is not None
    assert config.rope_scaling.attention_factor == pytest.approx(attention)
    cos, _ = rope_cos_sin(config.head_dim, 8, config.rope_theta, scaling=config.rope_scaling)
    assert float(cos[0].max()) == pytest.approx(attention)  # position 0: cos 1, times it
