"""Weights kept in GGUF's quantized blocks, and projections computed from them.

A decode step on a CPU streams every weight once, so the bytes a weight takes set the speed.
`QuantizedWeight` holds a `[out, in]` projection weight as GGUF stores it, blocks of 32 weights
along `in` with an fp16 scale each:

- Q4_0: 4-bit u per weight, w = d (u - 8): 4.5 bits a weight;
- Q4_1: 4-bit u and an fp16 minimum m per block, w = d u + m: 5 bits;
- Q5_0: 5-bit u, w = d (u - 16): 5.5 bits; Q5_1: 5-bit u and a minimum, w = d u + m: 6 bits;
- Q8_0: 8-bit signed q, w = d q: 8.5 bits (held as u = q + 128, w = d (u - 128), so that all
  of them are `w = d u + m` with unsigned u, which is what the kernel multiplies).

`linear` computes `x W^T + b` from them without widening the weight: on CPUs with our native
kernels, `linear_quant` (kernels/native_quant.py, kernels/csrc/linear_quant.c) quantizes each
block of 32 values of a row to int8 with its own scale, as llama.cpp does, and takes exact
integer dot products; elsewhere `reference_linear` does the same arithmetic in torch (same
answer up to the order of fp32 sums, and slower). `dequantize` gives the weight back as
floats: the plain reference the tests hold both against. `rows` is an embedding lookup: the
rows it reads dequantized, by one call of kernels/csrc/quant_rows.c where our kernels run,
else in torch, the same bits.

Layout (linear_quant.c has the why): outputs go sixteen to a panel, and a panel's block of 32
input features is eight vectors of 64 bytes, vector v holding features 4v..4v+3 of the sixteen
outputs side by side. 8-bit codes are those 512 bytes; 4-bit codes pack vectors v and v + 4
into the low and high nibbles of 256 bytes; 5-bit codes add eight 64-bit masks of fifth bits.
Scales (and minimums) are `[panel][block][16]`. `unsigned_codes()`, `block_scales()` and
`block_mins()` give them back in natural order, `[out, ...]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import native, native_quant
from kernels.activation import silu_and_mul
from kernels.norm import rms_norm

BLOCK = 32  # weights per block
PANEL = 16  # outputs laid side by side
_UNPACK_ROWS = 4096  # rows per chunk when codes are unpacked (bits widen to bytes on the way)
KINDS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q8_0": 8}  # kind -> bits of a code
WITH_MINS = ("q4_1", "q5_1")  # the kinds with a minimum per block
_MIN_PER_SCALE = {"q4_0": -8, "q5_0": -16, "q8_0": -128}  # m = this * d, where no minimums
_REFERENCE_ROWS = 8  # rows per chunk of reference_linear (its products are [rows, out, blocks])


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedWeight:
    """A `[out_features, in_features]` weight in quantized blocks (see the module docstring)."""

    kind: str  # one of KINDS
    codes: torch.Tensor  # uint8 [panels, blocks * block bytes] (module docstring)
    scales: torch.Tensor  # fp16 [panels, blocks * 16]: d of each block
    mins: torch.Tensor | None  # fp16 like scales: m of each block (Q4_1, Q5_1); None otherwise
    in_features: int
    out_features: int
    _kernel: native_quant.QuantKernelArgs | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantized kind must be one of {', '.join(KINDS)}, not {self.kind}")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"{self.in_features} in features are not blocks of {BLOCK}")
        panels, blocks = -(-self.out_features // PANEL), self.in_features // BLOCK
        bytes_per_panel = blocks * native_quant.quant_block_bytes(self.bits)
        if self.codes.shape != (panels, bytes_per_panel):
            raise ValueError(f"codes of shape {tuple(self.codes.shape)} do not fit {self.shape}")
        if self.scales.shape != (panels, blocks * PANEL):
            raise ValueError(f"scales of shape {tuple(self.scales.shape)} do not fit {self.shape}")
        if (self.mins is not None) != (self.kind in WITH_MINS):
            raise ValueError("Q4_1 and Q5_1 weights, and they alone, carry a minimum per block")
        tensors = [self.codes, self.scales] + ([] if self.mins is None else [self.mins])
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("quantized weights are contiguous CPU tensors")
        if self.codes.dtype != torch.uint8 or self.scales.dtype != torch.float16:
            raise TypeError("codes are uint8 and scales fp16")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def kernel_args(self) -> native_quant.QuantKernelArgs:
        """What `native_quant.linear_quant` takes, checked once and kept."""
        if self._kernel is None:
            args = native_quant.quant_kernel_args(
                self.codes,
                self.scales,
                self.mins,
                _MIN_PER_SCALE.get(self.kind, 0),
                self.bits,
                self.in_features,
                self.out_features,
            )
            object.__setattr__(self, "_kernel", args)
        assert self._kernel is not None
        return self._kernel

    @property
    def bits(self) -> int:
        return KINDS[self.kind]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """What a projection streams: codes, scales and minimums (with the panels' padding)."""
        mins = 0 if self.mins is None else self.mins.numel() * 2
        return self.codes.numel() + self.scales.numel() * 2 + mins

    def block_scales(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp16 [out, in / 32] (or [len(rows), in / 32]): d of each block."""
        return _unpanel_scales(self.scales, self._rows(rows))

    def unsigned_codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [out, in] (or [len(rows), in]): the codes u in natural order."""
        picked = self._rows(rows)
        parts = [
            _unpack(self.codes, self.bits, self.in_features, picked[at : at + _UNPACK_ROWS])
            for at in range(0, picked.numel(), _UNPACK_ROWS)
        ]
        return torch.cat(parts) if parts else torch.empty(0, self.in_features, dtype=torch.uint8)

    def _rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is None:
            return torch.arange(self.out_features)
        return rows.to(device="cpu", dtype=torch.int64)

    def block_mins(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [out, in / 32] (or [len(rows), in / 32]): m of each block."""
        if self.mins is not None:
            return _unpanel_scales(self.mins, self._rows(rows)).float()
        return self.block_scales(rows).float() * _MIN_PER_SCALE[self.kind]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        """The weight as floats: d u + m per block, in fp32, then cast to `dtype`."""
        codes, scales = self.unsigned_codes(), self.block_scales()
        return self._dequantize_rows(codes, scales, self.block_mins(), dtype)

    def rows(
        self, ids: torch.Tensor, dtype: torch.dtype, use_native: bool = True
    ) -> torch.Tensor:  # [len(ids), in]
        """Rows `ids` dequantized (an embedding lookup), without widening the rest: in one call
        of our kernel where it runs, else in torch (the same bits)."""
        ids = ids.to(device="cpu", dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"row ids outside 0..{self.shape[0] - 1}")
        if use_native and native.available():
            return native_quant.quant_rows(self.kernel_args(), ids).to(dtype)
        codes, scales = self.unsigned_codes(ids), self.block_scales(ids)
        return self._dequantize_rows(codes, scales, self.block_mins(ids), dtype)

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedWeight:
        """Rows (dim 0) or whole blocks of input features (dim 1) picked by `index`, as
        tensor parallelism slices a weight."""
        if dim == 0:
            index = index.to(device="cpu", dtype=torch.int64)
            return from_codes(
                self.kind,
                self.unsigned_codes(index),
                self.block_scales(index),
                None if self.mins is None else self.block_mins(index).half(),
            )
        if dim != 1:
            raise ValueError("a weight has dims 0 and 1")
        first = int(index[0]) if index.numel() else 0
        if not torch.equal(index.cpu(), torch.arange(first, first + index.numel())) or (
            first % BLOCK or index.numel() % BLOCK
        ):
            raise ValueError(f"a quantized weight's input features split only at blocks of {BLOCK}")
        blocks = slice(first // BLOCK, (first + index.numel()) // BLOCK)
        mins = None if self.mins is None else self.block_mins().half()
        codes = self.unsigned_codes()[:, first : first + index.numel()]
        return from_codes(
            self.kind,
            codes.contiguous(),
            self.block_scales()[:, blocks],
            None if mins is None else mins[:, blocks],
        )

    @staticmethod
    def _dequantize_rows(
        codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        out = codes.shape[0]
        u = codes.view(out, -1, BLOCK).float()
        w = u * scales.float()[..., None] + mins[..., None]
        return w.reshape(out, -1).to(dtype)


Weight = torch.Tensor | QuantizedWeight  # a projection's weight, as a model holds it


def weight_nbytes(weight: Weight) -> int:
    """The bytes a pass over `weight` reads: its blocks and scales, or its elements."""
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def from_codes(
    kind: str,
    codes: torch.Tensor,  # uint8 [out, in]: unsigned codes in natural order
    scales: torch.Tensor,  # fp16 [out, in / 32]
    mins: torch.Tensor | None,  # fp16 [out, in / 32] for Q4_1 and Q5_1
) -> QuantizedWeight:
    """A weight from its codes, scales and minimums in natural order (laid out here)."""
    out, in_features = codes.shape
    panel_mins = None if mins is None else _panel_scales(mins)
    stored = _pack(codes, KINDS[kind])
    return QuantizedWeight(kind, stored, _panel_scales(scales), panel_mins, in_features, out)


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along their outputs (q/k/v into one projection); one kind, one
    input width."""
    first = parts[0]
    if any(p.kind != first.kind or p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one kind and input width stack")
    mins = None
    if first.mins is not None:
        mins = torch.cat([p.block_mins().half() for p in parts])
    return from_codes(
        first.kind,
        torch.cat([p.unsigned_codes() for p in parts]),
        torch.cat([p.block_scales() for p in parts]),
        mins,
    )


def linear(
    x: torch.Tensor,  # [rows, in_features] fp32 or bf16
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
    use_native: bool = True,
) -> torch.Tensor:  # [rows, out_features], x's dtype
    """`x W^T + b` from the quantized blocks: our kernel where it runs, else the same arithmetic
    in torch. Rows of another dtype are computed in fp32 and cast back."""
    kernel = weight._kernel
    if (  # the decode step's case, with as few checks as keep it right (linear_quant's)
        kernel is not None
        and bias is None
        and use_native
        and x.dtype in _ROW_DTYPES
        and native.grad_free(x)
        and native.available()
    ):
        return native_quant.linear_quant(x, kernel)
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of shape {weight.shape}")
    dtype = x.dtype
    if dtype not in _ROW_DTYPES or not x.is_cpu:
        return linear(x.float().cpu(), weight, bias, use_native).to(dtype=dtype, device=x.device)
    if bias is not None and bias.dtype != dtype:
        bias = bias.to(dtype)
    if use_native and native.available() and native.grad_free(x, bias):
        return native_quant.linear_quant(x, weight.kernel_args(), bias)
    return reference_linear(x, weight, bias)


_ROW_DTYPES = (torch.float32, torch.bfloat16)


def norm_linear(
    x: torch.Tensor,  # [rows, in_features]
    residual: torch.Tensor | None,  # [rows, in_features]
    norm_weight: torch.Tensor,  # [in_features]
    eps: float,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (projection of norm(x + residual), x + residual)
    """The projection of a layer's RMSNorm, which nothing else reads: one kernel call for bf16
    rows on our kernels (the same bits as the norm and the projection apart), else the two."""
    if (
        _fusable(x)
        and norm_weight.dtype == torch.bfloat16
        and (residual is None or (residual.dtype == torch.bfloat16 and residual.is_contiguous()))
    ):
        kernel_bias = None if bias is None else bias.to(torch.bfloat16)
        return native_quant.linear_quant_after_norm(
            x, residual, norm_weight, eps, weight.kernel_args(), kernel_bias
        )
    normed, total = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), total


def silu_linear(gate_up: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The projection of SwiGLU's `silu(gate) * up`: one kernel call for bf16 rows on our
    kernels (the same bits as the two apart), else the two."""
    if _fusable(gate_up):
        return native_quant.linear_quant_after_silu(gate_up, weight.kernel_args())
    return linear(silu_and_mul(gate_up), weight)


def _fusable(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.is_cpu
        and x.is_contiguous()
        and native.grad_free(x)
        and native.available()
    )


def quantize_rows(
    x: torch.Tensor,  # [rows, in] fp32 or bf16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [rows, in] int8, dx, sx [rows, blocks]
    """The rows as the kernel quantizes them: per block of 32, dx = max|x| / 127, q = x / dx
    rounded to nearest even, sx = dx sum(q); q in natural order."""
    rows = x.shape[0]
    blocks = x.float().view(rows, -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    dx = amax / 127
    # A true division, as the kernel's (`127 / tensor` is a reciprocal times 127 in torch).
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse[..., None]).clamp(-128, 127)
    sx = dx * q.sum(dim=-1)
    return q.to(torch.int8).reshape(rows, -1), dx, sx


def reference_linear(
    x: torch.Tensor,  # [rows, in] fp32 or bf16
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out], x's dtype
    """The kernel's arithmetic in torch: rows quantized per block, exact integer dot products
    (small enough to be exact in fp32), d dx per block, then the m sx terms and the bias."""
    u = weight.unsigned_codes().view(weight.shape[0], -1, BLOCK).float()  # [out, blocks, 32]
    scales, mins = weight.block_scales().float(), weight.block_mins()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    for start in range(0, x.shape[0], _REFERENCE_ROWS):
        q, dx, sx = quantize_rows(x[start : start + _REFERENCE_ROWS])
        q = q.float().view(q.shape[0], -1, BLOCK)
        dots = torch.einsum("rbk,obk->rob", q, u)  # [rows, out, blocks]
        main = (dots * (scales[None] * dx[:, None, :])).sum(dim=-1)
        out[start : start + q.shape[0]] = main + sx @ mins.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def dequantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x W^T + b` with the weight dequantized and the rows as they are, in fp32: the plain
    reference (it differs from `linear` by the rows' int8 rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.dequantize(torch.float32), b)


def _panel_scales(natural: torch.Tensor) -> torch.Tensor:  # [out, blocks] -> [panels, b * 16]
    out, blocks = natural.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, blocks, dtype=natural.dtype)
    padded[:out] = natural
    return padded.view(panels, PANEL, blocks).transpose(1, 2).reshape(panels, -1).contiguous()


def _unpanel_scales(panelled: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    grid = panelled.view(panelled.shape[0], -1, PANEL)  # [panel, block, output]
    return grid[rows // PANEL, :, rows % PANEL]  # [rows, blocks]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:  # uint8 [out, in] -> panels
    out, in_features = codes.shape
    blocks, panels = in_features // BLOCK, -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=torch.uint8)
    padded[:out] = codes
    # [panel, block, v, output, i]: vector v of a block holds features 4v + i of every output.
    grid = padded.view(panels, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 8:
        return grid.reshape(panels, -1).contiguous()
    low = grid & 0x0F
    pairs = (low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(panels, blocks, 256)
    if bits == 4:
        return pairs.reshape(panels, -1).contiguous()
    fifth = (grid >> 4).reshape(panels, blocks, 8, 8, 8)  # [..., v, byte, bit]: bit 4j + i
    masks = (fifth << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
    return torch.cat([pairs, masks.reshape(panels, blocks, 64)], dim=2).reshape(panels, -1)


def _unpack(stored: torch.Tensor, bits: int, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """uint8 [len(rows), in]: rows' codes out of the panels."""
    panels, blocks = stored.shape[0], in_features // BLOCK
    p, j = rows // PANEL, rows % PANEL
    per_block = stored.view(panels, blocks, -1)
    if bits == 8:
        picked = per_block.view(panels, blocks, 8, PANEL, 4)[p, :, :, j]  # [rows, blocks, 8, 4]
        return picked.reshape(-1, in_features)
    pairs = per_block[:, :, :256].reshape(panels, blocks, 4, PANEL, 4)[p, :, :, j]
    codes = torch.cat([pairs & 0x0F, pairs >> 4], dim=2)  # [rows, blocks, 8 (v), 4]
    if bits == 5:
        masks = per_block[p, :, 256:].reshape(-1, blocks, 8, 8)  # [rows, blocks, v, byte]
        bits_ = (masks[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # bit 8 byte + k
        fifth = bits_.reshape(-1, blocks, 8, PANEL, 4)  # bit 4 j + i
        picked = fifth[torch.arange(rows.numel()), :, :, j]  # [rows, blocks, 8, 4]
        codes = codes | (picked << 4)
    return codes.reshape(-1, in_features).contiguous()
