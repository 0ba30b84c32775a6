"""Uniform-batch paged attention (the graph path's): the torch version and the Triton kernel
against the float64 reference of tests/unit/test_attention.py.

The Triton kernel runs on the CPU under Triton's interpreter (fp32 and fp16; the interpreter
mishandles bf16), in a subprocess so that the interpreted kernel never stays cached in a
process that has a GPU; `pytest -m cuda` runs it compiled, bf16 included."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from kernels.attention_uniform import UniformTorchAttention, select_uniform_backend
from tests.unit.helpers import run_interpreted
from tests.unit.test_attention import NUM_KV_HEADS, build_case, expected_output

UNIFORM_CASES = [
    (1, [1, 37, 16], 16),  # decode: a first token, a long context, one whole block
    (3, [40, 3, 17], 4),  # verification of 2 drafts, blocks of 4
    (5, [5, 70], 8),  # a context that is all new tokens; one across many blocks
]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(("width", "seq_lens", "block_size"), UNIFORM_CASES)
def test_the_torch_version_matches_the_reference(
    width: int, seq_lens: list[int], block_size: int
) -> None:
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        [width] * len(seq_lens), seq_lens, block_size, torch.float32
    )
    backend = UniformTorchAttention()
    out = backend.forward(query, key_cache, value_cache, backend.prepare(meta), 0.25)
    torch.testing.assert_close(out, expected_output(query, meta, contexts, 0.25))


def test_a_mixed_batch_is_refused() -> None:
    _, _, _, meta, _, _ = build_case([1, 2], [5, 5], 4, torch.float32)
    with pytest.raises(ValueError, match="one query length"):
        UniformTorchAttention().prepare(meta)


def test_the_cpu_gets_the_torch_version() -> None:
    backend = select_uniform_backend(torch.device("cpu"), torch.bfloat16, 64, 3, 5)
    assert isinstance(backend, UniformTorchAttention)


def test_shapes_the_kernel_cannot_serve_are_named() -> None:
    from kernels.attention_triton import kernel_problem

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert "head_dim 8" in str(kernel_problem(cuda, bf16, 8, 2, 5))
    assert "head_dim 96" in str(kernel_problem(cuda, bf16, 96, 2, 5))
    assert "exceed one tile" in str(kernel_problem(cuda, bf16, 128, 16, 17))
    assert "not supported" in str(kernel_problem(cuda, torch.float64, 64, 3, 5))
    assert "runs on CUDA" in str(kernel_problem(torch.device("cpu"), bf16, 64, 3, 5))


INTERPRETED = textwrap.dedent(
    """
    import torch
    from kernels.attention_triton import kernel_problem, triton_uniform_attention
    from kernels.attention_uniform import uniform_attention_reference

    gen = torch.Generator().manual_seed(0)
    for num_seqs, width, heads, kv_heads, head_dim, block_size, dtype in [
        (3, 5, 4, 2, 16, 8, torch.float32),  # verify: 5 tokens x 2 query heads per KV head
        (2, 1, 9, 3, 64, 16, torch.float32),  # decode with SmolLM2's heads
        (2, 3, 8, 2, 32, 16, torch.float16),
    ]:
        shape = (40, block_size, kv_heads, head_dim)
        key_cache = torch.randn(shape, generator=gen).to(dtype)
        value_cache = torch.randn(shape, generator=gen).to(dtype)
        tables = torch.randint(0, 40, (num_seqs, 12), generator=gen)
        seq_lens = torch.tensor([width + 7, width + 70, width][:num_seqs])
        query = torch.randn(num_seqs * width, heads, head_dim, generator=gen).to(dtype)
        group = heads // kv_heads
        assert kernel_problem(query.device, dtype, head_dim, group, width, interpret=True) is None
        args = (query, key_cache, value_cache, tables, seq_lens, width, head_dim**-0.5)
        got = triton_uniform_attention(*args).float()
        want = uniform_attention_reference(*args).float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    print("ok")
    """
)


@needs_triton
def test_the_triton_kernel_matches_the_torch_version_interpreted() -> None:
    run_interpreted(INTERPRETED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "seq_lens", "block_size"), UNIFORM_CASES)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_the_triton_kernel_on_cuda(
    _: None, width: int, seq_lens: list[int], block_size: int, dtype: torch.dtype
) -> None:
    from kernels.attention_triton import TritonUniformAttention

    query, key_cache, value_cache, meta, contexts, _slots = build_case(
        [width] * len(seq_lens), seq_lens, block_size, dtype
    )
    cuda = torch.device("cuda")
    backend = select_uniform_backend(
        cuda, dtype, query.shape[-1], query.shape[1] // NUM_KV_HEADS, width
    )
    assert isinstance(backend, TritonUniformAttention)
    plan = backend.prepare(
        type(meta)(
            meta.block_size,
            meta.query_start_loc.to(cuda),
            meta.seq_lens.to(cuda),
            meta.block_tables.to(cuda),
            meta.slot_mapping.to(cuda),
            meta.query_lens_host,
            meta.seq_lens_host,
        )
    )
    out = backend.forward(query.to(cuda), key_cache.to(cuda), value_cache.to(cuda), plan, 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.cpu().float(),
        expected_output(query, meta, contexts, 0.25).float(),
        rtol=tolerance,
        atol=tolerance,
    )
