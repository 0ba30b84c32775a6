"""`y = x W^T + b`, with faster paths for the few-row case of reduced-precision CPU decode.

Decode and verification bring a handful of rows (1, or k + 1) and are bound by streaming the
weights. On an AVX512-BF16 CPU, oneDNN's bf16 GEMM as `F.linear` streams them at 6-11 GB/s
whatever the row count. Faster, in order of preference (kernels/native.py has the C kernels;
tests/benchmarks/bench_forward.py prints the comparison):
- a weight packed once at load (`pack`: its features in pairs, 16 outputs side by side) goes
  through `native.linear_amx` for up to AMX_MAX_ROWS bf16 rows where the CPU has AMX (~25
  GB/s, and 1 to 16 rows cost the same), else through `native.linear_packed`, AVX512 dot
  products that use each weight they load for up to 8 rows: on an AMD Zen 4, 1.3x faster than
  the unpacked kernel below for one row, 8 rows for about one row's time, and faster than
  torch's bf16 GEMM at any row count, so it takes them all;
- our AVX512 kernel (`native.linear_bf16`) for an unpacked weight, whose dot products grow dearer
  with every row. Where the CPU has AVX512-BF16 it takes up to NATIVE_MAX_ROWS rows; where it
  lacks it (the "avx512f" build) torch's bf16 GEMM converts every operand and is 1.6-3x slower
  than ours at any row count, so ours takes them all;
- `torch.mv` (one row) and `W @ x^T` (the weight as the left operand: a GEMM with a small N,
  for 2..MAX_SMALL_ROWS rows), ~1.5x faster than `F.linear`.
Long bf16 prefill chunks keep `F.linear`. fp32 rows go to `native.linear_f32` (the unpacked
kernel's fp32 build) at any row count: each output one sum in a fixed order, so a token's row
does not depend on its batch as torch's fp32 GEMM's does (it blocks by the row count, and one
row is a GEMV that sums in another order); on the 2-core VM it is also 1.2-6x faster than
`F.linear` for the bundled model's shapes, from 1 to 512 rows.

A weight kept in quantized blocks (`kernels.quant.QuantizedWeight`) goes to `quant.linear`
whatever the rows: 4.5-8.5 bits a weight instead of 16, so a decode step streams a third to a
half of the bytes (kernels/quant.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import batch_invariant, native, quant
from kernels.quant import QuantizedWeight, Weight

_FAST_DTYPES = (torch.bfloat16, torch.float16)
MAX_SMALL_ROWS = 32
NATIVE_MAX_ROWS = 4
# Past this many rows the AMX kernel, which reads the weight again for every 32 rows, falls
# behind oneDNN's GEMM (64 vs 73 ms for 512 rows of all the bundled model's weights).
AMX_MAX_ROWS = 256


@dataclass(frozen=True, slots=True, eq=False)
class PackedWeight:
    """A bf16 weight re-laid for `native.linear_amx` and `native.linear_packed`, and the weight
    it was made from: `linear` uses it only while that weight is the same tensor, unchanged
    (else it falls back)."""

    data: torch.Tensor
    source_ptr: int
    source_version: int
    shape: tuple[int, int]

    def fits(self, weight: torch.Tensor) -> bool:
        return (
            weight.data_ptr() == self.source_ptr
            and _version(weight) == self.source_version
            and tuple(weight.shape) == self.shape
            and weight.dtype == torch.bfloat16
        )


def pack(weight: torch.Tensor) -> PackedWeight | None:  # weight: [out_features, in_features]
    """The weight packed for our kernels, or None where they cannot take it (none here, not
    bf16, in features not a multiple of 32). Costs a copy of the weight."""
    if (
        weight.dtype != torch.bfloat16
        or not native.grad_free(weight)
        or weight.dim() != 2
        or weight.device.type != "cpu"
        or weight.shape[1] % native.TILE_FEATURES
        or not native.available()
    ):
        return None
    with torch.no_grad():
        data = native.pack_bf16(weight)
    shape = (weight.shape[0], weight.shape[1])
    return PackedWeight(data, weight.data_ptr(), _version(weight), shape)


class WeightPacks:
    """A module's packed copies of the weights it projects with, made on first use and remade
    when a weight changes (a `.to(dtype)`, new weights loaded). Packs nothing where our kernels
    cannot run, so fp32 models and other CPUs pay one dictionary lookup."""

    def __init__(self) -> None:
        self._packs: dict[str, PackedWeight | None] = {}
        self._unpackable: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        # Every row count through the fixed-tile kernel (kernels/batch_invariant.py), so a row's
        # result never depends on its batch: `--deterministic` on a GPU.
        self.batch_invariant = False

    def get(self, name: str, weight: Weight) -> PackedWeight | None:
        if isinstance(weight, QuantizedWeight):
            return None  # read in its blocks
        packed = self._packs.get(name)
        if packed is not None and packed.fits(weight):
            return packed
        key = (weight.data_ptr(), weight.dtype, tuple(weight.shape))
        if self._unpackable.get(name) == key or not native.available():
            return None
        packed = pack(weight)
        self._packs[name] = packed
        if packed is None:
            self._unpackable[name] = key
        return packed

    def linear(
        self,
        name: str,
        x: torch.Tensor,  # [num_rows, in_features]
        weight: Weight,  # [out_features, in_features]
        bias: torch.Tensor | None = None,  # [out_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        """`linear` with the pack this holder keeps for `weight` under `name`."""
        if type(weight) is QuantizedWeight:  # the hot path of a quantized model's step
            return quant.linear(x, weight, bias)
        if self.batch_invariant and isinstance(weight, torch.Tensor):
            return batch_invariant.linear(x, weight, bias)
        return linear(x, weight, bias, self.get(name, weight))

    def nbytes(self) -> int:
        return sum(p.data.numel() * 2 for p in self._packs.values() if p is not None)


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: Weight,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    packed: PackedWeight | None = None,  # pack(weight), when the caller keeps one
    use_native: bool = True,
) -> torch.Tensor:  # [num_rows, out_features]
    if isinstance(weight, QuantizedWeight):
        return quant.linear(x, weight, bias, use_native)
    rows = x.shape[0]
    if x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32:
        if _fp32_native_ok(x, weight, bias, use_native):
            return native.linear_f32(x, weight, bias)
        return F.linear(x, weight, bias)
    if x.dtype not in _FAST_DTYPES:
        return F.linear(x, weight, bias)
    native_ok = (
        use_native
        and native.grad_free(x, weight, bias)
        and x.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and native.available()
    )
    if native_ok and packed is not None and packed.fits(weight):
        if not native.amx_available():
            return native.linear_packed(x, packed.data, weight.shape[0], bias)
        if rows <= AMX_MAX_ROWS:
            return native.linear_amx(x, packed.data, weight.shape[0], bias)
    if native_ok and rows <= native_max_rows() and weight.is_contiguous():
        return native.linear_bf16(x, weight, bias)
    if rows > MAX_SMALL_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mv(weight, x[0]).unsqueeze(0) if rows == 1 else torch.mm(weight, x.T).T.contiguous()
    return out if bias is None else out + bias


def native_max_rows() -> int:
    """The most rows `linear` sends to `native.linear_bf16` (0 where it cannot run)."""
    variant = native.variant()
    if variant is None:
        return 0
    return NATIVE_MAX_ROWS if variant in ("avx512_bf16", "neon_bf16_i8mm") else sys.maxsize


def _fp32_native_ok(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_native: bool
) -> bool:
    return (
        use_native
        and weight.dtype == torch.float32
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and weight.is_contiguous()
        and weight.device.type == "cpu"
        and native.grad_free(x, weight, bias)
        and native.available()
    )


def row_independent_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """Up to how many rows a `linear` of `dtype` (bf16 with its weight's pack, where one is
    kept) computes each row from that row and the weight alone, so that a row's result does not
    depend on the rest of the batch: what our kernels take (0 without them, or while
    `native.disabled()`; torch's GEMMs block by batch)."""
    if dtype == torch.float32:
        return sys.maxsize if native.available() else 0
    if native.available() and not native.amx_available():
        return sys.maxsize  # linear_packed takes every row count
    return max(AMX_MAX_ROWS if native.amx_available() else 0, native_max_rows())


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter; -1 for an inference tensor, which keeps none (an
    inference-mode write to a weight goes unnoticed: repack by hand after one)."""
    return -1 if t.is_inference() else t._version
