"""Projections whose every row is computed alike whatever the batch: `--deterministic` on a GPU.

cuBLAS picks its GEMM by the problem's shape: a batch of 1 runs a GEMV, larger batches other
tilings and, for narrow outputs, split-K reductions whose partial sums meet in another order.
A token's row of `x W^T` therefore changes in its last bits with the number of rows beside it,
and greedy decoding turns a changed last bit into a different near-tie, then a different text
(issue 51). Here one Triton kernel takes every row count with tiles fixed by the weight's shape
alone: each output is one sum over the input features in BLOCK_K steps, in the same order, with
the same instructions, wherever its row sits and however many rows come with it. No split-K:
the outputs' tiles give the device its parallelism.

`linear` is `F.linear` in this form (fp32 accumulation, the bias added in fp32, one rounding to
the output's dtype; fp32 inputs multiply in IEEE fp32, not TF32). It runs on CUDA, or on the CPU
under `TRITON_INTERPRET=1`, where tests/unit/test_batch_invariant.py checks it against torch and
bit for bit across batches; `pytest -m cuda` checks it compiled. The attention half of the mode
is kernels/attention_invariant.py; norms, SwiGLU and rotary are row-wise already
(kernels/fused_triton.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kernels.fused_triton import triton_available

BLOCK_M = 32  # rows a program takes: fixed, so a row's arithmetic never depends on the batch
BLOCK_N = 64  # outputs a program takes
BLOCK_K = 64  # input features per step of each output's sum
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs interpreted on the CPU (`TRITON_INTERPRET=1`: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why `linear` cannot take these tensors (None: it can)."""
    if not (x.is_cuda or interpreting()):
        return "the batch-invariant kernels run on CUDA (or under TRITON_INTERPRET=1)"
    if not triton_available():
        return "triton is not installed"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"need rows [m, k] and a weight [n, k], got {tuple(x.shape)}, {tuple(weight.shape)}"
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"need matching fp32/bf16/fp16 rows and weight, got {x.dtype}, {weight.dtype}"
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],)):
        return "the bias needs the weight's outputs and dtype"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight)):
        return "the kernel computes no gradients"
    return None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rows_times_weight(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        feats = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k_ok = start + feats < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + (start + feats)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[None, :] * stride_w + (start + feats)[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]: the weight's rows as columns
            if IEEE:  # noqa: SIM108 (a constexpr branch, as Triton compiles it)
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * stride_o + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return rows_times_weight


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """`x W^T + b`, each row computed alike in any batch (see the module docstring)."""
    why = problem(x, weight, bias)
    if why is not None:
        raise ValueError(why)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
    _kernel()[grid](
        x,
        weight,
        weight if bias is None else bias,  # not read without a bias
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return out
