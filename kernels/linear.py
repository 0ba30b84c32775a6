"""`y = x W^T + b`, with a faster path for the one-row case of reduced-precision CPU decode.

At one row, oneDNN's bf16 GEMM (what `F.linear` reaches) streams weights at about 11 GB/s on
an AVX512-BF16 CPU, while `torch.mv`'s GEMV streams the same weights at 16-23 GB/s
(benchmarks/bench_forward.py prints both). Single-stream decode is exactly that case, and it
is memory-bound, so it takes the GEMV. fp32 gains nothing there and keeps `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu" and x.dtype in _GEMV_DTYPES:
        out = torch.mv(weight, x[0]).unsqueeze(0)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
