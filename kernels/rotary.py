"""Rotary position embeddings in the Hugging Face ("neox", rotate-half) layout.

llama.cpp stores llama Q/K weights permuted for its interleaved rotary variant; the GGUF loader
undoes that permutation, so every model here uses this one layout.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    head_dim: int, max_positions: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # ([max_positions, head_dim], same) fp32
    """Cosine and sine tables for every position, computed in fp32 as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim], x's dtype
    sin: torch.Tensor,  # [num_tokens, head_dim], x's dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
