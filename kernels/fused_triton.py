"""The small per-layer steps of a forward as one Triton kernel each, for CUDA.

Inside a captured CUDA graph a decode step of a small model costs what its kernels cost to
start, not what they compute: torch runs RMSNorm with its residual add as three or four
kernels, SwiGLU as two, and rotary plus the K/V write as about ten. Here each is one:
- `add_rms_norm`: (norm(x + residual), x + residual), the sum rounded to the model's dtype
  before it is normalized (as torch's add then norm, and our CPU kernel, do);
- `silu_mul`: silu(gate) * up over the fused gate/up projection's output, in fp32, rounded once;
- `rotary_kv`: Q and K heads rotated in place in the fused QKV output from the fp32 angle
  tables (rounded once), and K and V written into their cache slots.

kernels/norm.py, activation.py and rotary.py call these for CUDA tensors when Triton is
installed; torch's ops are their reference (tests/unit/test_fused_triton.py, under Triton's
interpreter on the CPU and compiled under `pytest -m cuda`).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels take these tensors: CUDA, no autograd, Triton installed."""
    present = [t for t in tensors if t is not None]
    return (
        all(t.is_cuda for t in present)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in present))
        and triton_available()
    )


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, dim,
        stride_x, stride_r, stride_o, stride_s,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < dim
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)  # rounded to the dtype
        s = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / dim + eps)
        w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), ok)

    @triton.jit
    def silu_mul_kernel(
        x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rotary_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, key_ptr, value_ptr,
        stride_qkv, stride_table, stride_slot,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        head = tl.program_id(1)  # query heads, then key heads (each with its value head)
        half = tl.arange(0, HALF)
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_ptr + position * stride_table + half)
        sin = tl.load(sin_ptr + position * stride_table + half)
        at = qkv_ptr + token * stride_qkv + head * 2 * HALF
        x1 = tl.load(at + half).to(tl.float32)
        x2 = tl.load(at + HALF + half).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
        tl.store(at + half, y1)
        tl.store(at + HALF + half, y2)
        if head >= NUM_HEADS:
            kv = head - NUM_HEADS
            slot = tl.load(slots_ptr + token)
            cache_at = slot * stride_slot + kv * 2 * HALF
            tl.store(key_ptr + cache_at + half, y1)
            tl.store(key_ptr + cache_at + HALF + half, y2)
            v_at = at + NUM_KV_HEADS * 2 * HALF  # this K head's value head
            tl.store(value_ptr + cache_at + half, tl.load(v_at + half))
            tl.store(value_ptr + cache_at + HALF + half, tl.load(v_at + HALF + half))

    return {"norm": add_rms_norm_kernel, "silu": silu_mul_kernel, "rotary": rotary_kv_kernel}


def rows_problem(*rows: torch.Tensor | None) -> str | None:
    """Why the row-wise kernels (`add_rms_norm`, `silu_mul`) cannot take these tensors (None:
    they can; a None tensor is absent)."""
    for t in rows:
        if t is not None and (t.dim() != 2 or t.stride(1) != 1):
            return "it needs 2-d rows with contiguous features"
    return None


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
    problem = rows_problem(x, residual)
    if problem is not None:
        raise ValueError(f"add_rms_norm: {problem}")
    num_tokens, dim = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    _kernels()["norm"][(num_tokens,)](
        x, r, weight, out, total, eps, dim,
        x.stride(0), r.stride(0), out.stride(0), total.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=_pow2(dim), num_warps=4 if dim <= 4096 else 8,
    )  # fmt: skip
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 inter] -> [.., inter]
    problem = rows_problem(gate_up)
    if problem is not None:
        raise ValueError(f"silu_mul: {problem}")
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    grid = (num_tokens, -(-inter // block))
    _kernels()["silu"][grid](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


def rotary_problem(
    qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> str | None:
    """Why `rotary_kv` cannot take these tensors (None: it can)."""
    half = key_cache.shape[-1] // 2
    if key_cache.shape[-1] % 2 or half & (half - 1):
        return f"it needs head_dim / 2 a power of two, got {key_cache.shape[-1]}"
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        return "it needs contiguous caches"
    return rows_problem(qkv)


def rotary_kv(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 kv_heads) * head_dim], rotated in place
    num_heads: int,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_table: torch.Tensor,  # [max_positions, head_dim] fp32
    sin_table: torch.Tensor,  # [max_positions, head_dim] fp32
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # same
) -> None:
    problem = rotary_problem(qkv, key_cache, value_cache)
    if problem is not None:
        raise ValueError(f"rotary_kv: {problem}")
    num_tokens = qkv.shape[0]
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if num_tokens == 0:
        return
    _kernels()["rotary"][(num_tokens, num_heads + kv_heads)](
        qkv, cos_table, sin_table, positions, slot_mapping, key_cache, value_cache,
        qkv.stride(0), cos_table.stride(0), key_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, HALF=head_dim // 2, num_warps=1,
    )  # fmt: skip
