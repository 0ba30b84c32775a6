"""Our C kernel for projections over weights kept in GGUF's quantized blocks (kernels/csrc/
linear_quant.c), loaded with the others (kernels/native.py): each row is quantized to int8 per
block of 32 and the dot products are exact integer ones (VNNI), so a step streams 4.5-8.5 bits
a weight. kernels/quant.py holds the weights; this module checks them once (`QuantKernelArgs`)
and calls the kernel, alone or fused with the RMSNorm or SwiGLU before it. `quant_rows` is the
embedding lookup's kernel (kernels/csrc/quant_rows.c): the rows of such a weight dequantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.native import library


@dataclass(frozen=True, slots=True)
class QuantKernelArgs:
    """A quantized weight as `linear_quant` passes it to the kernel: checked once, when made
    (`quant_kernel_args`), so that each call costs little more than the kernel."""

    codes: int  # pointers into tensors the weight keeps alive
    scales: int
    mins: int | None
    min_per_scale: int
    bits: int
    in_features: int
    out_features: int


def quant_block_bytes(bits: int) -> int:
    """Bytes of a block of 32 features of a panel of 16 outputs in linear_quant.c's layout."""
    return {4: 256, 5: 320, 8: 512}[bits]


def quant_kernel_args(
    codes: torch.Tensor,  # uint8 [panels of 16 outputs, blocks * quant_block_bytes]
    scales: torch.Tensor,  # fp16 [panels, blocks * 16] (kernels/quant.py)
    mins: torch.Tensor | None,  # fp16 like scales (Q4_1), or None: m = min_per_scale d
    min_per_scale: int,
    bits: int,  # 4, 5 or 8
    in_features: int,
    out_features: int,
) -> QuantKernelArgs:
    """The kernel's view of a weight in quantized blocks; raises where the tensors do not fit.
    The caller keeps the tensors alive while it uses the result."""
    panels, blocks = -(-out_features // 16), in_features // 32
    tensors = [codes, scales] + ([] if mins is None else [mins])
    if (
        bits not in (4, 5, 8)
        or in_features <= 0
        or in_features % 32
        or codes.dtype != torch.uint8
        or codes.shape != (panels, blocks * quant_block_bytes(bits))
        or scales.dtype != torch.float16
        or scales.shape != (panels, blocks * 16)
        or (mins is not None and (mins.shape != scales.shape or mins.dtype != torch.float16))
        or not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    ):
        raise ValueError(f"not a quantized weight of {out_features} x {in_features}")
    return QuantKernelArgs(
        codes.data_ptr(),
        scales.data_ptr(),
        None if mins is None else mins.data_ptr(),
        int(min_per_scale),
        bits,
        in_features,
        out_features,
    )


def linear_quant(
    x: torch.Tensor,  # [rows, in_features] fp32 or bf16
    weight: QuantKernelArgs,
    bias: torch.Tensor | None = None,  # [out_features], x's dtype
) -> torch.Tensor:  # [rows, out_features], x's dtype
    """`x W^T + b` from a weight in quantized blocks (kernels/csrc/linear_quant.c): each block of
    32 values of a row quantized to int8, exact integer dot products, fp32 sums, rounded once to
    bf16 for bf16 rows. A row's result does not depend on the other rows nor on the thread
    count. Call only when `available()`. (A decode step makes a hundred of these calls: the
    checks are the few that keep the kernel inside its tensors.)"""
    x_f32 = _QUANT_ROWS.get(x.dtype)
    if x_f32 is None or x.dim() != 2 or not x.is_cpu:
        raise TypeError("linear_quant takes 2-D fp32 or bf16 CPU rows")
    rows, out_features = x.shape[0], weight.out_features
    if x.shape[1] != weight.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit {weight.in_features} in features")
    if bias is not None and (
        bias.dtype != x.dtype or bias.shape != (out_features,) or not bias.is_contiguous()
    ):
        raise ValueError("the bias must be a contiguous vector of out_features in x's dtype")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype)
    if rows and out_features:
        _scratch_had(
            library().outrider_linear_quant(x.data_ptr(), x_f32, *_weight_args(weight, bias, y))
        )
    return y


def linear_quant_after_norm(
    x: torch.Tensor,  # [rows, in_features] bf16
    residual: torch.Tensor | None,  # [rows, in_features] bf16
    norm_weight: torch.Tensor,  # [in_features] bf16
    eps: float,
    weight: QuantKernelArgs,
    bias: torch.Tensor | None = None,  # [out_features] bf16
) -> tuple[torch.Tensor, torch.Tensor]:  # (projection of the norm, x + residual)
    """`linear_quant(rms_norm_bf16(x, norm_weight, eps, residual)[0], weight, bias)` and the
    sum, in one call, the same bits. Call only when `available()`."""
    tensors = [x, norm_weight] + [t for t in (residual, bias) if t is not None]
    if any(t.dtype != torch.bfloat16 or not t.is_cpu or not t.is_contiguous() for t in tensors):
        raise TypeError("linear_quant_after_norm takes contiguous bf16 CPU tensors")
    rows, in_features = x.shape
    if (
        in_features != weight.in_features
        or norm_weight.shape != (in_features,)
        or (residual is not None and residual.shape != x.shape)
        or (bias is not None and bias.shape != (weight.out_features,))
    ):
        raise ValueError("x, residual, norm weight and bias do not fit the weight")
    total = x if residual is None else torch.empty_like(x)
    y = torch.empty(rows, weight.out_features, dtype=torch.bfloat16)
    if rows:
        sum_out = None if residual is None else total
        _linear_quant_after(1, x, residual, norm_weight, eps, sum_out, weight, bias, y)
    return y, total


def linear_quant_after_silu(
    gate_up: torch.Tensor,  # [rows, 2 in_features] bf16
    weight: QuantKernelArgs,
) -> torch.Tensor:  # [rows, out_features]
    """`linear_quant(silu_mul_bf16(gate_up), weight)` in one call, the same bits. Call only when
    `available()`."""
    if gate_up.dtype != torch.bfloat16 or not gate_up.is_cpu or not gate_up.is_contiguous():
        raise TypeError("linear_quant_after_silu takes contiguous bf16 CPU rows")
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.in_features:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} does not fit the weight")
    y = torch.empty(gate_up.shape[0], weight.out_features, dtype=torch.bfloat16)
    if gate_up.shape[0]:
        _linear_quant_after(2, gate_up, None, None, 0.0, None, weight, None, y)
    return y


def _linear_quant_after(
    prologue: int,  # 1: RMSNorm, 2: SwiGLU (linear_quant.c)
    a: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    sum_out: torch.Tensor | None,
    weight: QuantKernelArgs,
    bias: torch.Tensor | None,
    y: torch.Tensor,
) -> None:
    code = library().outrider_linear_quant_after(
        prologue,
        a.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if norm_weight is None else norm_weight.data_ptr(),
        eps,
        None if sum_out is None else sum_out.data_ptr(),
        *_weight_args(weight, bias, y),
    )
    _scratch_had(code)


def quant_rows(
    weight: QuantKernelArgs,
    ids: torch.Tensor,  # int64 [n] on the CPU, each in 0..out_features - 1
) -> torch.Tensor:  # fp32 [n, in_features]
    """Rows `ids` of the weight dequantized (kernels/csrc/quant_rows.c): the bits
    `QuantizedWeight.rows` computes in torch, in one call. The caller checks the ids."""
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), weight.in_features)
    if ids.numel():
        library().outrider_quant_rows(
            weight.codes,
            weight.scales,
            weight.mins,
            weight.min_per_scale,
            weight.bits,
            weight.in_features,
            ids.data_ptr(),
            ids.numel(),
            out.data_ptr(),
        )
    return out


def _weight_args(
    weight: QuantKernelArgs, bias: torch.Tensor | None, y: torch.Tensor
) -> tuple[object, ...]:
    """The arguments both quantized entry points end with: the weight, bias, output, sizes."""
    return (
        weight.codes,
        weight.scales,
        weight.mins,
        weight.min_per_scale,
        weight.bits,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.shape[0],
        weight.in_features,
        weight.out_features,
        torch.get_num_threads(),
    )


def _scratch_had(code: int) -> None:
    if code:
        raise MemoryError("linear_quant could not allocate its scratch")


_QUANT_ROWS = {torch.float32: 1, torch.bfloat16: 0}  # the dtypes linear_quant takes: x_f32


def quantize_rows(
    x: torch.Tensor,  # [rows, in_features] fp32 or bf16, in_features % 32 == 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q int8 [rows, in], dx, sx [rows, blocks]
    """The rows as `linear_quant` quantizes them."""
    lib = library()
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] % 32:
        raise ValueError("quantize_rows takes [rows, 32 k] fp32 or bf16 rows")
    x = x.contiguous()
    rows, in_features = x.shape
    q = torch.empty(rows, in_features, dtype=torch.int8)
    dx = torch.empty(rows, in_features // 32)
    sx = torch.empty(rows, in_features // 32)
    lib.outrider_quantize_rows(
        x.data_ptr(),
        int(x.dtype == torch.float32),
        rows,
        in_features,
        q.data_ptr(),
        dx.data_ptr(),
        sx.data_ptr(),
    )
    return q, dx, sx
