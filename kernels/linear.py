"""`y = x W^T + b`, with faster paths for the few-row case of reduced-precision CPU decode.

Decode and verification bring a handful of rows (1, or k + 1) and are bound by streaming the
weights. On an AVX512-BF16 CPU, oneDNN's bf16 GEMM as `F.linear` reaches it streams them at
6-11 GB/s whatever the row count. Faster, in order of preference:
- our AVX512-BF16 kernel (kernels/native.py) for up to NATIVE_MAX_ROWS bf16 rows: it streams
  each weight once at ~25 GB/s, but its dot products are plain vector instructions, so past a
  few rows the arithmetic, not the memory, sets its pace;
- `torch.mv` (one row) and `W @ x^T` (the weight as the left operand: a GEMM with a small N,
  for 2..MAX_SMALL_ROWS rows), ~1.5x faster than `F.linear`.
tests/benchmarks/bench_forward.py prints the comparison. fp32 gains nothing and keeps
`F.linear`, as do prefill chunks (many rows: compute-bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native

_FAST_DTYPES = (torch.bfloat16, torch.float16)
MAX_SMALL_ROWS = 32
NATIVE_MAX_ROWS = 4


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
    use_native: bool = True,
) -> torch.Tensor:  # [num_rows, out_features]
    rows = x.shape[0]
    if (
        x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype not in _FAST_DTYPES
        or rows > MAX_SMALL_ROWS
    ):
        return F.linear(x, weight, bias)
    if (
        use_native
        and rows <= NATIVE_MAX_ROWS
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and (bias is None or bias.dtype == torch.bfloat16)
        and native.available()
    ):
        return native.linear_bf16(x, weight, bias)
    out = torch.mv(weight, x[0]).unsqueeze(0) if rows == 1 else torch.mm(weight, x.T).T.contiguous()
    return out if bias is None else out + bias
