"""SwiGLU's `silu(gate) * up` over the fused gate/up projection's output: our one-call C kernel
for bf16 on CPUs that run it (kernels/native.py, computed in fp32 and rounded once), one Triton
kernel on CUDA (kernels/fused_triton.py, likewise), torch's ops elsewhere and wherever autograd
needs gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fused_triton, native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 inter] -> [.., inter]
    if (
        gate_up.dtype == torch.bfloat16
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and gate_up.device.type == "cpu"
        and native.grad_free(gate_up)
        and native.available()
    ):
        return native.silu_mul_bf16(gate_up)
    if (
        gate_up.is_cuda
        and fused_triton.rows_problem(gate_up) is None
        and fused_triton.usable(gate_up)
    ):
        return fused_triton.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
