"""Weights in GGUF's quantized blocks (kernels/quant.py) and the kernel that projects with them
(kernels/csrc/linear_quant.c), against plain-torch references."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels import linear as linear_module
from kernels import native, native_quant, quant, quant_gguf
from kernels.quant import QuantizedWeight
from workers.model.gguf_loader import unpermute_qk

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
KINDS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
# (out, in): outputs not a multiple of the kernel's tile of 4; inputs of one block, of a last
# group with fewer than four blocks (96: three; 576: 18 blocks, the bundled model's width), and
# of whole groups only (1536).
SHAPES = [(37, 576), (5, 96), (1, 32), (130, 1536)]
ROWS = [1, 3, 8, 9, 17]  # one pass of the kernel's 8 rows, more, and past 16 (rows quantized
# on all threads)


def _weight(out: int, inn: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inn, generator=gen) * inn**-0.5


def _gguf_reference(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """llama.cpp's own quantize-then-dequantize (gguf-py), in fp32."""
    qtype = GGMLQuantizationType[kind.upper()]
    raw = gguf_quantize(weight.numpy(), qtype)
    return torch.from_numpy(np.array(gguf_dequantize(raw, qtype)).reshape(weight.shape))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out", "inn"), SHAPES)
def test_blocks_decode_as_gguf_decodes_them(kind: str, out: int, inn: int) -> None:
    weight = _weight(out, inn, seed=out + inn)
    q = quant_gguf.quantize(weight, kind)
    expected = _gguf_reference(weight, kind)
    assert torch.equal(q.dequantize(), expected)
    rows = torch.tensor([out - 1, 0])
    assert torch.equal(q.rows(rows, torch.float32), expected[rows])
    assert torch.equal(q.index_select(0, rows).dequantize(), expected[rows])
    assert torch.equal(quant.cat_rows([q, q]).dequantize(), torch.cat([expected, expected]))
    if inn >= 64:  # whole blocks of input features, as a row-parallel rank takes them
        cols = torch.arange(32, 64)
        assert torch.equal(q.index_select(1, cols).dequantize(), expected[:, 32:64])
    bits = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5}[kind]
    assert q.nbytes >= out * inn * bits / 8  # what a step streams, scales' padding included


@pytest.mark.slow
def test_the_bundled_models_blocks_are_kept_as_the_file_holds_them(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Its Q4_1 projections and Q8_0 embedding, read as blocks, decode to the floats the
    float loader reads (llama.cpp's Q/K row order undone in both)."""
    from workers.model.loader import load_checkpoint

    quantized = load_checkpoint(quantization="gguf")
    for name in (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        held = quantized.weights[name]
        assert isinstance(held, QuantizedWeight)
        assert held.kind == ("q8_0" if "embed" in name else "q4_1")
        assert torch.equal(held.dequantize(), checkpoint.weights[name])
    assert isinstance(quantized.weights["model.norm.weight"], torch.Tensor)


def test_unpermuting_rows_commutes_with_dequantizing() -> None:
    weight = _weight(96, 64, seed=1)
    q = quant_gguf.quantize(weight, "q4_1")
    unpermuted = unpermute_qk(q, num_heads=3)
    assert isinstance(unpermuted, QuantizedWeight)
    assert torch.equal(unpermuted.dequantize(), unpermute_qk(q.dequantize(), num_heads=3))


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("out", "inn"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_torch_reference(
    kind: str, out: int, inn: int, dtype: torch.dtype
) -> None:
    """The kernel and `reference_linear` (the path without our kernels) do the same arithmetic,
    up to the order of fp32 sums; both are close to the weight dequantized and the rows as they
    are (they differ from it by the rows' int8 rounding)."""
    q = quant_gguf.quantize(_weight(out, inn, seed=7), kind)
    gen = torch.Generator().manual_seed(out)
    x = torch.randn(max(ROWS), inn, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    plain = quant.dequantized_linear(x, q, bias)
    for rows in ROWS:
        got = quant.linear(x[:rows], q, bias)
        want = quant.reference_linear(x[:rows], q, bias)
        assert got.dtype == dtype and got.shape == (rows, out)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # both round fp32 sums to bf16: at most one bf16 step apart
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)
        error = (got.float() - plain[:rows]).norm() / plain[:rows].norm()
        assert error < 0.02


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("magnitude", [1.0, 1e-3])  # 1e-3: subnormal fp16 scales
def test_a_lookup_in_one_call_gives_the_torch_lookups_bits(kind: str, magnitude: float) -> None:
    """The embedding lookup's kernel (kernels/csrc/quant_rows.c) against `rows` in torch: every
    panel position, a partial last panel, repeats, and a cast to bf16 after."""
    out, inn = 37, 576
    q = quant_gguf.quantize(_weight(out, inn, seed=11) * magnitude, kind)
    if magnitude < 1:
        assert (q.scales.abs() < 2**-14).any() and (q.scales != 0).any()
    ids = torch.tensor([*range(out), out - 1, 0, 17, 17])
    for dtype in (torch.float32, torch.bfloat16):
        got = q.rows(ids, dtype)
        assert torch.equal(got, q.rows(ids, dtype, use_native=False))
    assert q.rows(torch.tensor([], dtype=torch.int64), torch.float32).shape == (0, inn)


@needs_native
def test_the_rows_are_quantized_as_the_reference_quantizes_them() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 96, generator=gen).bfloat16()
    x[2, :32] = 0  # an all-zero block: scale 0
    q, dx, sx = native_quant.quantize_rows(x)
    want_q, want_dx, want_sx = quant.quantize_rows(x)
    assert torch.equal(q, want_q) and torch.equal(dx, want_dx)
    torch.testing.assert_close(sx, want_sx)


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_batch_nor_the_threads(kind: str) -> None:
    """What speculative decoding's exactness rests on: a row verified beside others, or beside
    k drafts, gets the bits it gets alone."""
    q = quant_gguf.quantize(_weight(70, 576, seed=3), kind)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(19, 576, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen).bfloat16()
    together = quant.linear(x, q, bias)
    for r in range(x.shape[0]):
        assert torch.equal(quant.linear(x[r : r + 1], q, bias)[0], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant.linear(x, q, bias), together)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_without_our_kernels_the_torch_path_gives_the_same_answer() -> None:
    """A CPU without AVX512 (here: the kernels switched off) runs `reference_linear`."""
    q = quant_gguf.quantize(_weight(40, 192, seed=9), "q4_1")
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(9))
    fast = quant.linear(x, q)
    with native.disabled():
        slow = linear_module.linear(x, q)  # the model's entry point dispatches on the weight
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)


AVX512F_SCRIPT = """
import json, sys, torch
from kernels import native, native_quant, quant, quant_gguf
out = {}
for kind in ("q4_1", "q8_0"):
    torch.manual_seed(0)
    q = quant_gguf.quantize(torch.randn(21, 160) * 0.1, kind)
    x = torch.randn(3, 160).bfloat16()
    out[kind] = quant.linear(x, q).view(torch.int16).tolist()
print(json.dumps({"variant": native.variant(), "out": out}))
"""


@pytest.mark.slow  # builds the other variant of the library
@needs_native
def test_the_avx512f_build_computes_the_same_bits() -> None:
    """The build for AVX512 CPUs without VNNI emulates the byte dot product exactly: the same
    outputs, bit for bit (in a process of its own: the build is chosen at load)."""
    env = {**os.environ, "OUTRIDER_NATIVE_KERNELS": "avx512f"}
    done = subprocess.run(
        [sys.executable, "-c", AVX512F_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    there = json.loads(done.stdout.strip().splitlines()[-1])
    here: dict[str, list[list[int]]] = {}
    for kind in ("q4_1", "q8_0"):
        torch.manual_seed(0)
        q = quant_gguf.quantize(torch.randn(21, 160) * 0.1, kind)
        x = torch.randn(3, 160).bfloat16()
        here[kind] = quant.linear(x, q).view(torch.int16).tolist()
    assert there["variant"] == "avx512f"
    assert there["out"] == here


@needs_native
def test_bad_inputs_are_refused() -> None:
    q = quant_gguf.quantize(_weight(8, 64, seed=2), "q8_0")
    with pytest.raises(ValueError, match="does not fit"):
        quant.linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError, match="does not fit"):
        quant.linear(torch.randn(64), q)
    with pytest.raises(TypeError):
        native_quant.linear_quant(torch.randn(2, 64).half(), q.kernel_args())
    with pytest.raises(ValueError, match="bias"):
        native_quant.linear_quant(torch.randn(2, 64), q.kernel_args(), torch.randn(7))
    with pytest.raises(ValueError, match="not a quantized weight"):
        native_quant.quant_kernel_args(q.codes, q.scales[:, :16], None, -128, 8, 64, 8)
    with pytest.raises(ValueError, match="not blocks of 32"):
        quant_gguf.quantize(torch.randn(4, 40), "q4_0")
    with pytest.raises(ValueError, match="kind"):
        quant_gguf.quantize(torch.randn(4, 64), "q3_k")
    with pytest.raises(IndexError):
        q.rows(torch.tensor([8]), torch.float32)
    with pytest.raises(ValueError, match="blocks of 32"):
        q.index_select(1, torch.arange(16))
    with pytest.raises(ValueError, match="one kind"):
        quant.cat_rows([q, quant_gguf.quantize(_weight(8, 64, seed=2), "q4_0")])


def _random_blocks(
    gen: np.random.Generator, out: int, blocks: int, size: int, scales_at: list[int]
) -> np.ndarray:
    """Random bytes of `blocks` GGUF blocks a row, with finite fp16 scales at `scales_at`."""
    raw = gen.integers(0, 256, size=(out, blocks, size), dtype=np.uint8)
    for at in scales_at:
        scale = gen.uniform(0.001, 0.01, size=(out, blocks)).astype(np.float16)
        raw[:, :, at : at + 2] = scale[..., None].view(np.uint8).reshape(out, blocks, 2)
    return raw.reshape(out, blocks * size)


@pytest.mark.parametrize(
    ("kind", "held_as", "block_size", "size", "scales_at", "tolerance"),
    [
        ("q5_0", "q5_0", 32, 22, [0], 0.0),  # the file's blocks, random fifth bits included
        ("q5_1", "q5_1", 32, 24, [0, 2], 0.0),
        ("q4_k", "q4_1", 256, 144, [0, 2], 2**-10),  # sub-block scales rounded to fp16
        ("q5_k", "q5_1", 256, 176, [0, 2], 2**-10),
        ("q6_k", "q8_0", 256, 210, [208], 2**-7),  # requantized to 8 bits
    ],
)
def test_gguf_types_are_held_in_the_kernels_kinds(
    kind: str, held_as: str, block_size: int, size: int, scales_at: list[int], tolerance: float
) -> None:
    out, inn = 6, 512 + (32 if block_size == 32 else 0)  # 17 blocks: a last group of one
    raw = _random_blocks(np.random.default_rng(0), out, inn // block_size, size, scales_at)
    qtype = GGMLQuantizationType[kind.upper()]
    expected = torch.from_numpy(np.array(gguf_dequantize(raw, qtype), dtype=np.float32))
    held = quant_gguf.from_gguf_tensor(kind, raw, inn)
    assert held.kind == held_as
    got = held.dequantize()
    assert got.shape == expected.shape == (out, inn)
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    x = torch.randn(3, inn).bfloat16()
    error = (quant.linear(x, held).float() - x.float() @ expected.T).norm()
    assert error / (x.float() @ expected.T).norm() < 0.03


@needs_native
@pytest.mark.parametrize("with_residual", [False, True])
def test_a_norm_or_swiglu_before_the_projection_gives_the_same_bits_in_one_call(
    with_residual: bool,
) -> None:
    """What a quantized layer calls (`norm_linear`, `silu_linear`): one kernel call each, the
    bits of the norm (or SwiGLU) and the projection called apart."""
    from kernels.activation import silu_and_mul
    from kernels.norm import rms_norm

    gen = torch.Generator().manual_seed(11)
    q = quant_gguf.quantize(_weight(40, 96, seed=11), "q4_1")
    x = torch.randn(5, 96, generator=gen).bfloat16()
    residual = torch.randn(5, 96, generator=gen).bfloat16() if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(96, generator=gen)).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    y, total = quant.norm_linear(x, residual, norm_weight, 1e-5, q, bias)
    normed, want_total = rms_norm(x, norm_weight, 1e-5, residual)
    assert torch.equal(y, quant.linear(normed, q, bias)) and torch.equal(total, want_total)
    gate_up = torch.randn(5, 192, generator=gen).bfloat16()
    assert torch.equal(quant.silu_linear(gate_up, q), quant.linear(silu_and_mul(gate_up), q))
