"""Rotary position embeddings in the Hugging Face ("neox", rotate-half) layout.

llama.cpp stores llama Q/K weights permuted for its interleaved rotary variant; the GGUF loader
undoes that permutation, so every model here uses this one layout.

`rotate_and_store` is what an attention layer does with its fused QKV projection: rotate Q and
K, and store K and V in the paged cache. In bf16 on a CPU that runs our kernels that is one C
call (kernels/native.py `rotary_kv_bf16`: fp32 angles, one rounding), on CUDA one Triton kernel
(kernels/fused_triton.py `rotary_kv`, likewise); elsewhere torch's ops, in the model's dtype
as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import fused_triton, native
from kernels.attention import write_kv


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


@dataclass(slots=True)
class RotaryAngles:
    """The angles of one forward's tokens: the fp32 tables and each token's position. The
    per-token cos and sin in the model's dtype that torch's path multiplies by are gathered on
    first use (our kernel reads the tables)."""

    cos_table: torch.Tensor  # [max_positions, head_dim] fp32
    sin_table: torch.Tensor  # same
    positions: torch.Tensor  # [num_tokens] int64
    dtype: torch.dtype  # the model's
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, head_dim], dtype
        if self._gathered is None:
            self._gathered = (
                self.cos_table[self.positions].to(self.dtype),
                self.sin_table[self.positions].to(self.dtype),
            )
        return self._gathered


def rotate_and_store(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 kv_heads) * head_dim], from the projection
    num_heads: int,
    angles: RotaryAngles,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # same
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # q, [num_tokens, num_heads, head_dim] (a view; rows may be strided)
    """Rotate the new tokens' Q and K heads, write K and V into their cache slots and return the
    rotated Q. May rotate `qkv` in place, so the caller must not need it afterwards."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_tokens = qkv.shape[0]
    if (
        native.grad_free(qkv)
        and angles.positions.dtype == torch.int64
        and slot_mapping.dtype == torch.int64
        and native.rotary_kv_problem(qkv, angles.cos_table, key_cache, value_cache) is None
        and native.available()
    ):
        native.rotary_kv_bf16(
            qkv,
            num_heads,
            angles.positions.contiguous(),
            angles.cos_table,
            angles.sin_table,
            slot_mapping.contiguous(),
            key_cache,
            value_cache,
        )
        return qkv.view(num_tokens, -1, head_dim)[:, :num_heads]
    if (
        qkv.is_cuda
        and fused_triton.rotary_problem(qkv, key_cache, value_cache) is None
        and fused_triton.usable(qkv, key_cache, slot_mapping)
    ):
        fused_triton.rotary_kv(
            qkv,
            num_heads,
            angles.positions,
            angles.cos_table,
            angles.sin_table,
            slot_mapping,
            key_cache,
            value_cache,
        )
        return qkv.view(num_tokens, -1, head_dim)[:, :num_heads]
    heads = qkv.view(num_tokens, num_heads + 2 * kv_heads, head_dim)
    # Q and K heads sit side by side in the fused output: rotate them in one go.
    cos, sin = angles.cos_sin()
    qk = apply_rotary(heads[:, : num_heads + kv_heads], cos, sin)
    q, k = qk.split([num_heads, kv_heads], dim=1)
    write_kv(key_cache, value_cache, k, heads[:, num_heads + kv_heads :], slot_mapping)
    return q
