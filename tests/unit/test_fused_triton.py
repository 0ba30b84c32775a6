"""The fused Triton kernels (kernels/fused_triton.py) against torch's ops: under Triton's
interpreter on the CPU (fp32 and fp16, in a subprocess so that no interpreted kernel stays
cached in a process with a GPU), compiled on CUDA (`pytest -m cuda`, bf16 too)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.unit.helpers import run_interpreted

CHECKS = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from kernels import fused_triton
    from kernels.attention import write_kv
    from kernels.rotary import apply_rotary, rope_cos_sin

    def check(device, dtype):
        gen = torch.Generator().manual_seed(0)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        def close(got, want):
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)

        for tokens, hidden in [(3, 64), (5, 96), (1, 576)]:  # 96: a masked tail
            x, res, w = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
            normed, total = fused_triton.add_rms_norm(x, w, 1e-5, res)
            close(total, x + res)
            close(normed, F.rms_norm((x + res).float(), (hidden,), w.float(), 1e-5))
            alone, same = fused_triton.add_rms_norm(x, w, 1e-5)
            close(alone, F.rms_norm(x.float(), (hidden,), w.float(), 1e-5))
            assert same is x
        for tokens, inter in [(3, 48), (2, 1536), (1, 2000)]:
            gate_up = rand(tokens, 2 * inter)
            gate, up = gate_up.float().chunk(2, dim=-1)
            close(fused_triton.silu_mul(gate_up), F.silu(gate) * up)
        heads, kv_heads, dim, block = 4, 2, 16, 4
        cos, sin = rope_cos_sin(dim, 64, 10000.0)
        cos, sin = cos.to(device), sin.to(device)
        positions = torch.tensor([0, 5, 63, 17], device=device)
        slots = torch.tensor([9, 2, 30, 11], device=device)
        qkv = rand(4, (heads + 2 * kv_heads) * dim)
        key_cache = torch.zeros(8, block, kv_heads, dim, dtype=dtype, device=device)
        value_cache = torch.zeros_like(key_cache)
        split = qkv.float().view(4, heads + 2 * kv_heads, dim)
        rotated = apply_rotary(split[:, : heads + kv_heads], cos[positions], sin[positions])
        k_ref = torch.zeros(8, block, kv_heads, dim, device=device)
        v_ref = torch.zeros_like(k_ref)
        write_kv(k_ref, v_ref, rotated[:, heads:], split[:, heads + kv_heads :], slots)
        fused_triton.rotary_kv(qkv, heads, positions, cos, sin, slots, key_cache, value_cache)
        close(qkv.view(4, -1, dim)[:, : heads + kv_heads], rotated)
        close(key_cache, k_ref)
        close(value_cache, v_ref)

    DEVICE_AND_DTYPES
    print("ok")
    """
)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@needs_triton
def test_the_kernels_match_torch_interpreted() -> None:
    code = CHECKS.replace(
        "DEVICE_AND_DTYPES", "check('cpu', torch.float32); check('cpu', torch.float16)"
    )
    run_interpreted(code)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_match_torch_on_cuda() -> None:
    code = CHECKS.replace(
        "DEVICE_AND_DTYPES",
        "[check('cuda', d) for d in (torch.float32, torch.float16, torch.bfloat16)]",
    )
    namespace: dict[str, object] = {}
    exec(compile(code.replace('print("ok")', ""), "fused_checks", "exec"), namespace)


def test_inputs_the_kernels_cannot_take_are_named() -> None:
    """The dispatch falls back to torch for these, and the kernels refuse them by name."""
    from kernels import fused_triton

    rows = torch.zeros(4, 8)
    assert fused_triton.rows_problem(rows, None) is None
    assert fused_triton.rows_problem(rows.T) == "it needs 2-d rows with contiguous features"
    assert fused_triton.rows_problem(rows, torch.zeros(2, 4, 8)) is not None
    cache = torch.zeros(8, 4, 2, 16)
    qkv = torch.zeros(3, 8 * 16)
    assert fused_triton.rotary_problem(qkv, cache, cache) is None
    odd = torch.zeros(8, 4, 2, 12)  # head_dim / 2 = 6
    assert "power of two" in str(fused_triton.rotary_problem(qkv, odd, odd))
    assert "contiguous caches" in str(fused_triton.rotary_problem(qkv, cache, cache[:, :2]))
    with pytest.raises(ValueError, match="silu_mul: it needs 2-d rows"):
        fused_triton.silu_mul(torch.zeros(8, 4).T)
