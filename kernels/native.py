"""Our C kernels for the CPU (kernels/csrc), compiled on first use and loaded with ctypes.

- `linear_amx` multiplies up to a few hundred bf16 rows by a weight that `pack_bf16` re-laid
  once for AMX tiles: 1 to 16 rows cost the same, ~1.5x less than torch's one-row kernel
  (tests/benchmarks/bench_forward.py prints the comparison). CPUs with AMX (Sapphire Rapids on).
- `linear_packed` takes the same packed weight with AVX512 dot products, for CPUs without AMX:
  each weight it loads serves up to 8 rows, so 8 rows cost ~1.1x one row's time.
- `linear_bf16` multiplies rows by an unpacked weight with AVX512 dot products: faster than
  torch's kernels for one row, but dearer per extra row.
- `linear_quant` (kernels/native_quant.py) multiplies fp32 or bf16 rows by a weight kept in
  GGUF's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; kernels/quant.py): each row is
  quantized to int8 per block of 32 and the dot products are exact integer ones (VNNI), so a
  step streams 4.5-8.5 bits a weight.
- `rms_norm_bf16` is RMSNorm, optionally fused with the residual add before it, in one call
  instead of half a dozen torch ops.
- `paged_attention` attends each sequence's new tokens (bf16 or fp32) over the paged KV cache
  in place, where torch must gather the blocks before calling SDPA, each token from its own
  query and keys alone.
- `rotary_kv_bf16` rotates a layer's Q and K heads in place and writes K and V into their cache
  slots, and `silu_mul_bf16` is SwiGLU's `silu(gate) * up`: one call each where torch runs a
  dozen small ops (the elementwise work of a decode forward cost as much as a tenth of it).

The library is built and loaded by kernels/native_build.py (once per machine, on first use);
where it cannot be had, `available()` is False and callers keep torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Callable, Iterator

import torch

from kernels import native_build

log = logging.getLogger(__name__)

TILE_OUTPUTS, TILE_FEATURES = 16, 32  # a packed weight tile: outputs x input features


_enabled = True


def available() -> bool:
    """Whether the native kernels can run here (builds them on the first call)."""
    return _enabled and native_build.load_library()[0] is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Torch's kernels in place of ours inside the block (benchmarks compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def unavailable_reason() -> str | None:
    return native_build.load_library()[1]


def variant() -> str | None:
    """The build that runs here (kernels/native_build.py's VARIANTS: "avx512_bf16" or
    "avx512f" on x86-64, "sve256_bf16_i8mm", "neon_bf16_i8mm" or "neon" on AArch64), or None
    when none can."""
    return native_build.build_variant() if available() else None


def amx_available() -> bool:
    """Whether `pack_bf16` and `linear_amx` can run here (AMX tiles, and Linux granted them)."""
    return available() and native_build.amx_ready()


def grad_free(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd needs none of these tensors' gradients: our kernels have no backward,
    so callers keep torch's kernels otherwise."""
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors
    )


_ATTENTION_DTYPES = (torch.bfloat16, torch.float32)


def paged_attention_problem(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # same
) -> str | None:
    """Why `paged_attention` cannot take these tensors, or None when it can."""
    head_dim, num_heads, kv_heads = query.shape[2], query.shape[1], key_cache.shape[2]
    tensors = (query, key_cache, value_cache)
    dtype = query.dtype
    if dtype not in _ATTENTION_DTYPES or any(
        t.dtype != dtype or t.device.type != "cpu" for t in tensors
    ):
        return "paged_attention takes bf16 or fp32 CPU tensors, all of one dtype"
    if head_dim % 32 or head_dim > 256 or num_heads % kv_heads:
        return f"unsupported shape: {num_heads} heads over {kv_heads}, dim {head_dim}"
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "the KV cache must be contiguous"
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        return "each token's heads must be contiguous"
    return None


def library() -> ctypes.CDLL:
    lib = native_build.load_library()[0]
    if lib is None:
        raise RuntimeError(f"native kernels are unavailable: {unavailable_reason()}")
    return lib


def _amx_lib() -> ctypes.CDLL:
    lib = native_build.load_library()[0]
    if lib is None or not native_build.amx_ready():
        raise RuntimeError("AMX kernels are unavailable here")
    return lib


def pack_bf16(
    weight: torch.Tensor,  # [out_features, in_features] bf16
) -> torch.Tensor:  # [ceil(out_features / 16) * 16 * in_features] bf16
    """`weight` [out, in] re-laid in AMX tile order (out padded to a multiple of 16 with zeros),
    for `linear_amx` and `linear_packed`; `in` must be a multiple of 32. Call only when
    `available()`."""
    lib = library()
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        raise TypeError("pack_bf16 takes a 2-D bf16 CPU weight")
    out_features, in_features = weight.shape
    if in_features % TILE_FEATURES:
        raise ValueError(f"in_features must be a multiple of {TILE_FEATURES}, got {in_features}")
    weight = weight.contiguous()
    padded = -(-out_features // TILE_OUTPUTS) * TILE_OUTPUTS
    packed = torch.empty(padded * in_features, dtype=torch.bfloat16)
    lib.outrider_pack_bf16(weight.data_ptr(), packed.data_ptr(), out_features, in_features)
    return packed


def linear_amx(
    x: torch.Tensor,  # [rows, in_features] bf16
    packed: torch.Tensor,  # pack_bf16 of a [out_features, in_features] weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] bf16
) -> torch.Tensor:  # [rows, out_features] bf16
    """`x W^T + b` on AMX tiles, fp32 sums rounded once to bf16; a row's result does not depend
    on the other rows nor on the thread count. Call only when `amx_available()`."""
    return _project_packed(_amx_lib().outrider_linear_amx, x, packed, out_features, bias)


def linear_packed(
    x: torch.Tensor,  # [rows, in_features] bf16
    packed: torch.Tensor,  # pack_bf16 of a [out_features, in_features] weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] bf16
) -> torch.Tensor:  # [rows, out_features] bf16
    """`x W^T + b` with AVX512 dot products over a weight `pack_bf16` re-laid, fp32 sums rounded
    once to bf16; a row's result does not depend on the other rows nor on the thread count. For
    CPUs without AMX. Call only when `available()`."""
    return _project_packed(library().outrider_linear_packed, x, packed, out_features, bias)


def linear_bf16(
    x: torch.Tensor,  # [rows, in_features] bf16
    weight: torch.Tensor,  # [out_features, in_features] bf16, contiguous
    bias: torch.Tensor | None = None,  # [out_features] bf16
) -> torch.Tensor:  # [rows, out_features] bf16
    """`x W^T + b` with fp32 sums, each output rounded once to bf16. A row's result does not
    depend on the other rows, nor on the thread count. Call only when `available()`."""
    return _linear_unpacked("linear_bf16", torch.bfloat16, x, weight, bias)


def linear_f32(
    x: torch.Tensor,  # [rows, in_features] fp32
    weight: torch.Tensor,  # [out_features, in_features] fp32, contiguous
    bias: torch.Tensor | None = None,  # [out_features] fp32
) -> torch.Tensor:  # [rows, out_features] fp32
    """`x W^T + b` in fp32, each output one sum in a fixed order: a row's result does not depend
    on the other rows, nor on the thread count (torch's fp32 GEMM's does). Call only when
    `available()`."""
    return _linear_unpacked("linear_f32", torch.float32, x, weight, bias)


def _linear_unpacked(
    name: str,
    dtype: torch.dtype,
    x: torch.Tensor,  # [rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features], contiguous
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [rows, out_features]
    """The checks and the call of the unpacked projection kernel's `dtype` build (`name`)."""
    kernel = getattr(library(), f"outrider_{name}")
    if x.dtype != dtype or weight.dtype != dtype:
        raise TypeError(f"{name} takes {dtype} tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"{name} runs on the CPU")
    if not weight.is_contiguous():
        raise ValueError("the weight must be contiguous")
    return _project(kernel, x, weight, bias, weight.shape[0])


def _project_packed(
    kernel: Callable[..., None],
    x: torch.Tensor,  # [rows, in_features] bf16
    packed: torch.Tensor,  # pack_bf16 of a [out_features, in_features] weight
    out_features: int,
    bias: torch.Tensor | None,  # [out_features] bf16
) -> torch.Tensor:  # [rows, out_features] bf16
    """What the two kernels over a packed weight check before `_project`."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu":
        raise TypeError("a packed projection takes 2-D bf16 CPU rows")
    in_features = x.shape[1]
    padded = -(-out_features // TILE_OUTPUTS) * TILE_OUTPUTS
    if in_features % TILE_FEATURES or packed.numel() != padded * in_features:
        raise ValueError(
            f"the packed weight does not fit x {tuple(x.shape)} and {out_features} outputs"
        )
    return _project(kernel, x, packed, bias, out_features)


def _project(
    kernel: Callable[..., None],
    x: torch.Tensor,  # [rows, in_features] bf16 or fp32
    weight: torch.Tensor,  # the weight as `kernel` reads it (packed or not)
    bias: torch.Tensor | None,  # [out_features], x's dtype
    out_features: int,
) -> torch.Tensor:  # [rows, out_features], x's dtype
    """What the projection kernels share: the bias's check, the call, the output (of the rows'
    dtype)."""
    if bias is not None and (
        bias.dtype != x.dtype or bias.shape != (out_features,) or not bias.is_contiguous()
    ):
        raise ValueError(f"the bias must be a contiguous {x.dtype} vector of out_features")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype)
    if rows:
        kernel(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            x.shape[1],
            out_features,
            torch.get_num_threads(),
        )
    return y


def rms_norm_bf16(
    x: torch.Tensor,  # [rows, dim] bf16
    weight: torch.Tensor,  # [dim] bf16
    eps: float,
    residual: torch.Tensor | None = None,  # [rows, dim] bf16
) -> tuple[torch.Tensor, torch.Tensor]:  # (normalized, x + residual), [rows, dim] bf16 each
    """RMSNorm of `x + residual` (of `x` alone without one), in fp32, rounded once to bf16; the
    sum is rounded to bf16 first, as torch's add does. Returns the sum too (`x` itself when
    there is no residual). Call only when `available()`."""
    lib = library()
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    tensors = [x, weight] if residual is None else [x, weight, residual]
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        raise TypeError("rms_norm_bf16 takes bf16 CPU tensors")
    if residual is not None and residual.shape != x.shape:
        raise ValueError("the residual must have x's shape")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    total = x
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(x)
    if x.shape[0]:
        lib.outrider_rms_norm_bf16(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            None if residual is None else total.data_ptr(),
            x.shape[0],
            x.shape[1],
            torch.get_num_threads(),
        )
    return out, total


def rotary_kv_problem(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 kv_heads) * head_dim]
    cos_table: torch.Tensor,  # [positions, head_dim] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
) -> str | None:
    """Why `rotary_kv_bf16` cannot take these tensors, or None when it can."""
    head_dim = key_cache.shape[-1]
    if any(t.dtype != torch.bfloat16 for t in (qkv, key_cache, value_cache)):
        return "rotary_kv_bf16 takes a bf16 projection and cache"
    if cos_table.dtype != torch.float32 or cos_table.shape[-1] != head_dim:
        return "the angle tables must be fp32 [positions, head_dim]"
    tensors = (qkv, cos_table, key_cache, value_cache)
    if any(t.device.type != "cpu" for t in tensors):
        return "rotary_kv_bf16 takes CPU tensors"
    if head_dim % 32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        return f"unsupported shape: qkv {tuple(qkv.shape)}, head_dim {head_dim}"
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "the KV cache must be contiguous"
    return None


def rotary_kv_bf16(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 kv_heads) * head_dim] bf16, rows strided
    num_heads: int,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_table: torch.Tensor,  # [max_positions, head_dim] fp32
    sin_table: torch.Tensor,  # same
    slot_mapping: torch.Tensor,  # [num_tokens] int64: cache slot of each token
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] bf16, contiguous
    value_cache: torch.Tensor,  # same
) -> None:
    """Rotate the Q and K heads of each row of `qkv` in place (rotate-half layout, fp32 from the
    tables, rounded once to bf16) and write the rotated K heads and the V heads into the token's
    cache slot (kernels/csrc/rotary_kv_bf16.c). head_dim must be a multiple of 32. Raises
    IndexError, before writing anything, for a position or slot out of range. Call only when
    `available()`."""
    lib = library()
    problem = rotary_kv_problem(qkv, cos_table, key_cache, value_cache)
    if problem:
        raise ValueError(problem)
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    tokens = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv rows of {qkv.shape[1]} do not hold {num_heads}+2x{kv_heads} heads")
    if sin_table.shape != cos_table.shape or not (
        cos_table.is_contiguous() and sin_table.is_contiguous()
    ):
        raise ValueError("the angle tables must be contiguous and of one shape")
    for t in (positions, slot_mapping):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (tokens,):
            raise TypeError("positions and slots must be contiguous int64, one per token")
    if not tokens:
        return
    code = lib.outrider_rotary_kv_bf16(
        qkv.data_ptr(),
        qkv.stride(0),
        tokens,
        num_heads,
        kv_heads,
        head_dim,
        positions.data_ptr(),
        cos_table.data_ptr(),
        sin_table.data_ptr(),
        cos_table.shape[0],
        slot_mapping.data_ptr(),
        key_cache.shape[0] * key_cache.shape[1],
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        torch.get_num_threads(),
    )
    if code == 1:
        raise IndexError(f"a position is outside the rotary tables' {cos_table.shape[0]}")
    if code == 2:
        raise IndexError("a slot is outside the KV cache")


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 inter] -> [rows, inter]
    """`silu(gate) * up` of rows `[gate | up]`, in fp32, rounded once to bf16
    (kernels/csrc/silu_mul_bf16.c). Call only when `available()`."""
    lib = library()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [rows, 2 * inter] with unit-stride rows, not {gate_up.shape}"
        )
    if gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu":
        raise TypeError("silu_mul_bf16 takes a bf16 CPU tensor")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    if rows:
        lib.outrider_silu_mul_bf16(
            gate_up.data_ptr(),
            gate_up.stride(0),
            rows,
            inter,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] bf16 or fp32, tokens may be strided
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] query's, contiguous
    value_cache: torch.Tensor,  # same
    block_tables: torch.Tensor,  # [num_seqs, width] int32, contiguous
    query_starts: torch.Tensor,  # [num_seqs] int32: first row of each sequence's new tokens
    query_lens: torch.Tensor,  # [num_seqs] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context including the new tokens
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] query's: the sequences' rows are written
) -> None:
    """Causal attention of each sequence's new tokens over its cached context, read from the
    blocks in place (see kernels/csrc/paged_attention_bf16.c; paged_attention_f32.c is the same
    in fp32). head_dim must be a multiple of 32 (at most 256). Call only when `available()`."""
    lib = library()
    problem = paged_attention_problem(query, key_cache, value_cache) or (
        paged_attention_problem(out, key_cache, value_cache)
        if out.shape == query.shape
        else "out must have the query's shape"
    )
    if problem:
        raise ValueError(problem)
    for t in (block_tables, query_starts, query_lens, seq_lens):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise TypeError("the sequence tables must be contiguous int32")
    head_dim, num_heads = query.shape[2], query.shape[1]
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    kernel = (
        lib.outrider_paged_attention_f32
        if query.dtype == torch.float32
        else lib.outrider_paged_attention_bf16
    )
    kernel(
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_starts.data_ptr(),
        query_lens.data_ptr(),
        seq_lens.data_ptr(),
        seq_lens.shape[0],
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--all-builds"]:  # for images: kernels/native_build.py prebuild
        for path in native_build.prebuild():
            print(f"built {path}")
    if available():
        print(f"native CPU kernels: {variant()} build ready ({native_build.build()})")
    else:
        print(f"native CPU kernels: unavailable ({unavailable_reason()}); torch's kernels run")
