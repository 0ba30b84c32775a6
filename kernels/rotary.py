"""Rotary position embeddings in the Hugging Face ("neox", rotate-half) layout.

llama.cpp stores llama Q/K weights permuted for its interleaved rotary variant; the GGUF loader
undoes that permutation, so every model here uses this one layout.

A checkpoint that stretches its context past pretraining scales the rotary frequencies
(`RopeScaling`: linear, Llama 3's, YaRN, or per-frequency divisors as a GGUF file stores
Llama 3's); every kernel reads the fp32 cos/sin tables `rope_cos_sin` makes, so scaling is
decided there once, as transformers' `ROPE_INIT_FUNCTIONS` decide it.

`rotate_and_store` is what an attention layer does with its fused QKV projection: rotate Q and
K, and store K and V in the paged cache. In bf16 on a CPU that runs our kernels that is one C
call (kernels/native.py `rotary_kv_bf16`: fp32 angles, one rounding), on CUDA one Triton kernel
(kernels/fused_triton.py `rotary_kv`, likewise); elsewhere torch's ops, in the model's dtype
as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import fused_triton, native
from kernels.attention import write_kv

ROPE_SCALINGS = ("linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How a checkpoint scales its rotary frequencies (transformers' `rope_parameters`, resolved:
    every default filled in when the config was read)."""

    kind: str  # one of ROPE_SCALINGS
    factor: float = 1.0
    original_max_positions: int = 0  # the pretraining context (llama3, yarn)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range outwards
    attention_factor: float = 1.0  # multiplies cos and sin (yarn's mscale)
    freq_factors: tuple[float, ...] = ()  # freq_factors: each frequency's divisor

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {self.kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
        if self.factor <= 0 or self.attention_factor <= 0:
            raise ValueError("rope scaling factors must be positive")
        if self.kind in ("llama3", "yarn") and self.original_max_positions <= 0:
            raise ValueError(f"rope scaling {self.kind} needs original_max_position_embeddings")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        if self.kind == "freq_factors" and any(f <= 0 for f in self.freq_factors):
            raise ValueError("rope frequency factors must be positive")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:  # [head_dim // 2] fp32
    """Each rotary frequency (radians per position), scaled as the checkpoint asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(exponents, theta, head_dim, scaling)
    if len(scaling.freq_factors) != inv_freq.shape[0]:
        count = len(scaling.freq_factors)
        raise ValueError(f"{count} rope frequency factors for {inv_freq.shape[0]} frequencies")
    return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between (the pretraining context over low_freq_factor and over high_freq_factor)."""
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > s.original_max_positions / s.low_freq_factor
    short_wave = wavelen < s.original_max_positions / s.high_freq_factor
    scaled = torch.where(long_wave, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def _yarn_inv_freq(
    exponents: torch.Tensor, theta: float, head_dim: int, s: RopeScaling
) -> torch.Tensor:
    """YaRN's: frequencies that turn fewer than beta_slow times over the pretraining context
    interpolated (divided by `factor`), those turning more than beta_fast times kept, a
    linear ramp between."""

    def dim_of(rotations: float) -> float:  # the frequency index turning `rotations` times
        turns = s.original_max_positions / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate
    pos_freqs = theta**exponents
    return (1.0 / (s.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([max_positions, head_dim], same) fp32
    """Cosine and sine tables for every position, computed in fp32 as transformers does (times
    the scaling's attention factor, as transformers multiplies them)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [head_dim // 2]
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = 1.0 if scaling is None else scaling.attention_factor
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


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
