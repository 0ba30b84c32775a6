"""Rotary embedding against the complex-number formulation; config validation."""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import apply_rotary, rope_cos_sin
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_config_round_trip(arch: str) -> None:
    config = tiny_config(arch)
    again = ModelConfig.from_hf_config(config.to_hf_config())
    assert again == config


def test_hf_config_reads_transformers_5_rope_parameters_and_rejects_scaling() -> None:
    cfg = tiny_config().to_hf_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert ModelConfig.from_hf_config(cfg).rope_theta == 500.0
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_hf_config(cfg)
