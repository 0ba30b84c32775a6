"""RMSNorm, optionally after the residual add before it: our one-call C kernel for bf16 on CPUs
that run it (kernels/native.py), one Triton kernel on CUDA (kernels/fused_triton.py), torch's
ops elsewhere and wherever autograd needs gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fused_triton, native


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # (norm(x + residual), x + residual), each [num_tokens, hidden]
    """The norm of `x + residual` (of `x` without one) and that sum (`x` itself without one)."""
    if (
        x.dtype == weight.dtype == torch.bfloat16
        and (residual is None or (residual.dtype == x.dtype and residual.dim() == 2))
        and x.dim() == 2
        and x.device.type == "cpu"
        and native.grad_free(x, weight, residual)
        and native.available()
    ):
        return native.rms_norm_bf16(x, weight, eps, residual)
    if (
        x.is_cuda
        and fused_triton.rows_problem(x, residual) is None
        and fused_triton.usable(x, weight, residual)
    ):
        return fused_triton.add_rms_norm(x, weight, eps, residual)
    total = x if residual is None else x + residual
    return F.rms_norm(total, (total.shape[-1],), weight, eps), total
