"""The one-row GEMV path of kernels.linear against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen) / 8
    b = torch.randn(96, generator=gen) if with_bias else None
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    out = linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    assert out.shape == (rows, 96) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
