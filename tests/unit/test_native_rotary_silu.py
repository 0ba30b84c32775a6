"""Our rotary/KV-store and SiLU-and-multiply C kernels (kernels/native.py) against fp64
references, and the layer-level entry points that choose them."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from tests.unit.test_native_kernels import _bf16, needs_native


def _rotary_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [tokens, heads, head_dim] in fp64, from the angles."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = (positions.double()[:, None] * freqs)[:, None]  # [tokens, 1, half]
    lo, hi = x[..., :half].double(), x[..., half:].double()
    return torch.cat([lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()], -1)


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 70])  # 70: split between threads
@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 128)])
def test_rotary_kv_bf16_rotates_in_place_and_fills_the_slots(
    tokens: int, num_heads: int, kv_heads: int, head_dim: int
) -> None:
    from kernels.rotary import rope_cos_sin

    gen = torch.Generator().manual_seed(tokens * 10 + head_dim)
    width = (num_heads + 2 * kv_heads) * head_dim
    wide = _bf16(tokens, width + 32, gen=gen, scale=3.0)
    qkv = wide[:, 16 : 16 + width]  # strided rows, as a slice of a wider tensor
    before = qkv.clone()
    cos, sin = rope_cos_sin(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(16 * 8, generator=gen)[:tokens]
    key_cache = torch.full((8, 16, kv_heads, head_dim), 7.0, dtype=torch.bfloat16)
    value_cache = key_cache.clone()
    native.rotary_kv_bf16(qkv, num_heads, positions, cos, sin, slots, key_cache, value_cache)
    heads = before.view(tokens, -1, head_dim)
    expected = _rotary_reference(heads[:, : num_heads + kv_heads], positions, 10000.0)
    got = qkv.view(tokens, -1, head_dim)
    # fp32 from fp32 angle tables, rounded once: within a bf16 rounding of the exact rotation.
    torch.testing.assert_close(
        got[:, : num_heads + kv_heads].double(), expected, rtol=2**-8, atol=2e-3
    )
    assert torch.equal(got[:, num_heads + kv_heads :], heads[:, num_heads + kv_heads :])  # V as is
    keys, values = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(keys[slots], got[:, num_heads : num_heads + kv_heads])
    assert torch.equal(values[slots], heads[:, num_heads + kv_heads :])
    untouched = torch.ones(keys.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert bool((keys[untouched] == 7).all() and (values[untouched] == 7).all())
    # A token's result does not depend on its batch.
    alone = before[-1:].clone()
    native.rotary_kv_bf16(
        alone, num_heads, positions[-1:], cos, sin, slots[-1:], key_cache, value_cache
    )
    assert torch.equal(alone[0], qkv[-1])


@needs_native
def test_rotary_kv_bf16_refuses_what_it_cannot_compute_before_writing() -> None:
    from kernels.rotary import rope_cos_sin

    gen = torch.Generator().manual_seed(3)
    cos, sin = rope_cos_sin(64, 32, 10000.0)
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    qkv = _bf16(2, 4 * 64, gen=gen)
    before = qkv.clone()
    ok_positions, ok_slots = torch.tensor([0, 31]), torch.tensor([0, 31])

    def call(positions: torch.Tensor, slots: torch.Tensor, **kw: torch.Tensor) -> None:
        args = {"qkv": qkv, "cos": cos, "sin": sin, "cache": cache} | kw
        native.rotary_kv_bf16(
            args["qkv"], 2, positions, args["cos"], args["sin"], slots, args["cache"], args["cache"]
        )

    with pytest.raises(IndexError, match="position"):
        call(torch.tensor([0, 32]), ok_slots)
    with pytest.raises(IndexError, match="slot"):
        call(ok_positions, torch.tensor([-1, 3]))
    assert torch.equal(qkv, before) and not cache.any()  # nothing written
    with pytest.raises(ValueError, match="bf16"):
        call(ok_positions, ok_slots, qkv=qkv.float())
    with pytest.raises(ValueError, match="fp32"):
        call(ok_positions, ok_slots, cos=cos.bfloat16())
    with pytest.raises(ValueError, match="heads"):
        call(ok_positions, ok_slots, qkv=_bf16(2, 5 * 64, gen=gen))
    with pytest.raises(TypeError, match="int64"):
        call(ok_positions.int(), ok_slots)


@needs_native
@pytest.mark.parametrize("rows", [1, 70])  # 70: split between threads
@pytest.mark.parametrize("inter", [1536, 40])  # 40: a tail shorter than a vector
def test_silu_mul_bf16_matches_an_fp64_reference(rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = _bf16(rows, 2 * inter, gen=gen, scale=4.0)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp(-|g|) never overflows
    out = native.silu_mul_bf16(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = g * torch.sigmoid(g) * u
    assert out.shape == (rows, inter) and not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-6)
    assert torch.equal(native.silu_mul_bf16(gate_up[-1:])[0], out[-1])  # batch-independent


def test_rotate_and_store_and_silu_and_mul_agree_with_torch_in_fp32_and_bf16() -> None:
    """The layer-level entry points: torch's ops in fp32 (and without our kernels), our kernels
    in bf16 where they run; both within a bf16 rounding of each other."""
    from kernels.activation import silu_and_mul
    from kernels.rotary import RotaryAngles, rope_cos_sin, rotate_and_store

    gen = torch.Generator().manual_seed(11)
    cos, sin = rope_cos_sin(64, 256, 10000.0)
    positions, slots = torch.tensor([3, 200, 17]), torch.tensor([9, 0, 30])
    qkv = torch.randn(3, 5 * 64, generator=gen)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(2, 16, 1, 64, dtype=dtype), torch.zeros(2, 16, 1, 64, dtype=dtype)
        angles = RotaryAngles(cos, sin, positions, dtype)
        q = rotate_and_store(qkv.to(dtype), 3, angles, *cache, slots)
        results[dtype] = (q, cache[0].view(-1, 64)[slots], silu_and_mul(qkv[:, :128].to(dtype)))
    for ours, exact in zip(results[torch.bfloat16], results[torch.float32], strict=True):
        torch.testing.assert_close(ours.float(), exact, rtol=2**-7, atol=2e-2)


@needs_native
def test_silu_mul_bf16_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(4)
    with pytest.raises(ValueError, match="2 \\* inter"):
        native.silu_mul_bf16(_bf16(2, 31, gen=gen))  # not two halves
    with pytest.raises(ValueError, match="unit-stride"):
        native.silu_mul_bf16(_bf16(64, 2, gen=gen).T)  # columns apart
    with pytest.raises(ValueError, match="2 \\* inter"):
        native.silu_mul_bf16(_bf16(2, 2, 8, gen=gen))  # not 2-D
    with pytest.raises(TypeError, match="bf16"):
        native.silu_mul_bf16(torch.zeros(2, 8))
