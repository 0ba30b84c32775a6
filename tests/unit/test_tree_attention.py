"""Draft trees' attention (kernels/tree_attention.py): each node sees the cached context and its
ancestors, against a plain-torch reference, and a node's output is bit for bit its chain's."""

from __future__ import annotations

import importlib.util
import math
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.attention import AttentionMetadata, NativeCpuAttention, SdpaAttention
from kernels.attention_uniform import uniform_attention_reference
from kernels.tree_attention import TreeShape, tree_of, tree_rows
from tests.factories import scattered_block_ids
from tests.unit.helpers import run_interpreted

NUM_HEADS, NUM_KV_HEADS = 4, 2
BLOCK = 4
PARENTS = (-1, -1, 0, 0, 1, 2, 4)  # two children of the root, each with grandchildren
NATIVE = pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")


def test_tree_of_gives_depths_and_ancestors() -> None:
    shape = tree_of(10, PARENTS)
    assert shape.prefix == 10
    assert shape.positions == (10, 11, 11, 12, 12, 12, 13, 13)
    assert shape.visible[0] == (10,)
    assert shape.visible[6] == (10, 11, 13, 16)  # root, node 0, node 2, itself (node 5)
    assert tree_of(3, (-1, 0, 1)) == TreeShape(
        3, (3, 4, 5, 6), ((3,), (3, 4), (3, 4, 5), (3, 4, 5, 6))
    )
    with pytest.raises(ValueError, match="parent"):
        tree_of(0, (0,))


def _metadata(
    lens: list[tuple[int, int]], shapes: dict[int, TreeShape], tables: list[list[int]]
) -> AttentionMetadata:
    """Sequences of (new tokens, context including them); those in `shapes` are trees."""
    starts = [0]
    for q_len, _ in lens:
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    slots = [
        t[p // BLOCK] * BLOCK + p % BLOCK
        for t, (q_len, s_len) in zip(tables, lens, strict=True)
        for p in range(s_len - q_len, s_len)
    ]
    entries = [(i, starts[i], tables[i], shape) for i, shape in shapes.items()]
    return AttentionMetadata(
        block_size=BLOCK,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        query_lens_host=tuple(q for q, _ in lens),
        seq_lens_host=tuple(s for _, s in lens),
        tree=tree_rows(entries, BLOCK, torch.device("cpu")) if entries else None,
    )


def _reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row `[H, D]` over its keys and values `[n, KVH, D]`, in float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("hd,khd->hk", q.double(), k) * scale
    return torch.einsum("hk,khd->hd", scores.softmax(-1), v)


def _cache(dtype: torch.dtype, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (40, BLOCK, NUM_KV_HEADS, head_dim)
    return (torch.randn(shape, generator=gen) * 3).to(dtype), torch.randn(shape, generator=gen).to(
        dtype
    )


BACKENDS = [
    pytest.param(SdpaAttention(), torch.float32, 16, 1e-5, id="sdpa-fp32"),
    pytest.param(NativeCpuAttention(), torch.float32, 64, 1e-5, id="native-fp32", marks=NATIVE),
    pytest.param(NativeCpuAttention(), torch.bfloat16, 64, 2e-2, id="native-bf16", marks=NATIVE),
]


@pytest.mark.parametrize(("backend", "dtype", "head_dim", "tol"), BACKENDS)
def test_tree_rows_match_reference(
    backend: SdpaAttention, dtype: torch.dtype, head_dim: int, tol: float
) -> None:
    """A causal verify, a tree and a decode in one batch: every row as the reference has it."""
    key_cache, value_cache = _cache(dtype, head_dim, 0)
    tree_len = 1 + len(PARENTS)
    lens = [(3, 13), (tree_len, 9 + tree_len), (1, 22)]
    tables = [scattered_block_ids(s, BLOCK, 40, seed) for seed, (_, s) in enumerate(lens)]
    shape = tree_of(9, PARENTS)
    meta = _metadata(lens, {1: shape}, tables)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(meta.num_tokens, NUM_HEADS, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = backend.forward(query, key_cache, value_cache, backend.prepare(meta), scale)
    flat_k = key_cache.view(-1, NUM_KV_HEADS, head_dim)
    flat_v = value_cache.view(-1, NUM_KV_HEADS, head_dim)

    def slot(seq: int, logical: int) -> int:
        return tables[seq][logical // BLOCK] * BLOCK + logical % BLOCK

    expected = []
    row = 0
    for seq, (q_len, s_len) in enumerate(lens):
        for j in range(q_len):
            if seq == 1:
                logical = [*range(shape.prefix), *shape.visible[j]]
            else:
                logical = list(range(s_len - q_len + j + 1))
            slots = torch.tensor([slot(seq, p) for p in logical])
            expected.append(_reference(query[row], flat_k[slots], flat_v[slots], scale))
            row += 1
    torch.testing.assert_close(out.double(), torch.stack(expected), rtol=tol, atol=tol)


@NATIVE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tree_path_equals_its_chain_bit_for_bit(dtype: torch.dtype) -> None:
    """The tree's path root -> node 0 -> node 2 -> node 5, its K/V and queries those of a chain
    verified at contiguous positions: the path's outputs equal the chain's exactly."""
    head_dim, context = 64, 21
    key_cache, value_cache = _cache(dtype, head_dim, 2)
    table = scattered_block_ids(context + 1 + len(PARENTS), BLOCK, 40, 5)
    path = [0, 1, 3, 6]  # rows of root, node 0, node 2, node 5
    gen = torch.Generator().manual_seed(3)
    chain_q = torch.randn(len(path), NUM_HEADS, head_dim, generator=gen).to(dtype)
    chain_kv = [torch.randn(len(path), NUM_KV_HEADS, head_dim, generator=gen).to(dtype)] * 2
    flat_k = key_cache.view(-1, NUM_KV_HEADS, head_dim)
    flat_v = value_cache.view(-1, NUM_KV_HEADS, head_dim)

    def slot(logical: int) -> int:
        return table[logical // BLOCK] * BLOCK + logical % BLOCK

    backend = NativeCpuAttention()
    scale = 0.125
    # The chain: its four tokens at rows context .. context + 3.
    chain_slots = torch.tensor([slot(context + j) for j in range(len(path))])
    flat_k[chain_slots], flat_v[chain_slots] = chain_kv[0], chain_kv[1]
    n = len(path)
    meta = _metadata([(n, context + n)], {}, [table])
    chain_out = backend.forward(chain_q, key_cache, value_cache, backend.prepare(meta), scale)
    # The tree: every node's K/V in its own row, the path's those of the chain.
    tree_len = 1 + len(PARENTS)
    tree_q = torch.randn(tree_len, NUM_HEADS, head_dim, generator=gen).to(dtype)
    tree_q[path] = chain_q
    tree_slots = torch.tensor([slot(context + j) for j in range(tree_len)])
    flat_k[tree_slots] = torch.randn(tree_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    flat_k[tree_slots[path]], flat_v[tree_slots[path]] = chain_kv[0], chain_kv[1]
    meta = _metadata([(tree_len, context + tree_len)], {0: tree_of(context, PARENTS)}, [table])
    tree_out = backend.forward(tree_q, key_cache, value_cache, backend.prepare(meta), scale)
    assert torch.equal(tree_out[path], chain_out)
    assert not math.isnan(float(tree_out.float().sum()))


def _tail_case(
    dtype: torch.dtype, width: int
) -> tuple[tuple[torch.Tensor, ...], int, list[list[list[int]]]]:
    """A uniform batch of two sequences whose last rows are a tail of 8 (`tail_len`): the
    first a chain (causal masks), the second the tree of `PARENTS` with its root. With `width`
    8 the step verifies the tree (its tail is its new tokens); with fewer, its last `width`
    rows are new and see earlier rows of the tail by their bits, as the tree loop feeds a
    depth. Returns the kernel's inputs, the tail length, and each new token's logical rows."""
    head_dim, tail_len = 16, 1 + len(PARENTS)
    key_cache, value_cache = _cache(dtype, head_dim, 4)
    contexts = [13, 6]
    tables = [scattered_block_ids(c + tail_len, BLOCK, 40, 7 + i) for i, c in enumerate(contexts)]
    shape = tree_of(contexts[1], PARENTS)
    first_new = tail_len - width  # the tail's rows fed before this forward
    chain_masks = [(1 << (first_new + j + 1)) - 1 for j in range(width)]
    tree_keys = shape.visible[first_new:]
    tree_masks = [sum(1 << (v - contexts[1]) for v in keys) for keys in tree_keys]
    seq_lens = torch.tensor([c + tail_len for c in contexts])
    block_tables = torch.tensor([t + [0] * (12 - len(t)) for t in tables])
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2 * width, NUM_HEADS, head_dim, generator=gen).to(dtype)
    visible = [
        [list(range(contexts[0] + first_new + j + 1)) for j in range(width)],
        [[*range(contexts[1]), *keys] for keys in tree_keys],
    ]
    masks = torch.tensor([chain_masks, tree_masks])
    inputs = (query, key_cache, value_cache, block_tables, seq_lens, masks, tables)
    return inputs, tail_len, visible


@pytest.mark.parametrize("width", [8, 5])
def test_tail_masks_give_a_uniform_batch_its_trees(tmp_path: Path, width: int) -> None:
    """The graph path's form of a tree step (kernels/attention_uniform.py): a chain and a tree
    of 7 nodes, the new tokens seeing the cache before the tail and the tail rows their bits
    name, as the verifier's step (a tail of the new tokens) and as the tree loop's (three of
    the tree's rows fed before): every row as the reference has it; and the Triton kernel,
    interpreted on the CPU, the same."""
    (query, keys, values, tables, seq_lens, masks, logical), tail_len, visible = _tail_case(
        torch.float32, width
    )
    scale = query.shape[-1] ** -0.5
    out = uniform_attention_reference(
        query, keys, values, tables, seq_lens, width, scale, masks, tail_len
    )
    dim = query.shape[-1]
    flat_k, flat_v = keys.view(-1, NUM_KV_HEADS, dim), values.view(-1, NUM_KV_HEADS, dim)
    for seq in range(2):
        for j in range(width):
            rows = visible[seq][j]
            slots = torch.tensor([logical[seq][p // BLOCK] * BLOCK + p % BLOCK for p in rows])
            want = _reference(query[seq * width + j], flat_k[slots], flat_v[slots], scale)
            torch.testing.assert_close(out[seq * width + j].double(), want, rtol=1e-5, atol=1e-5)
    if importlib.util.find_spec("triton") is None:
        return
    case = tmp_path / "tree_case.pt"
    torch.save((query, keys, values, tables, seq_lens, width, scale, masks, tail_len, out), case)
    script = textwrap.dedent(
        f"""
        import torch
        from kernels.attention_triton import triton_uniform_attention
        *inputs, masks, tail_len, want = torch.load({str(case)!r})
        got = triton_uniform_attention(*inputs, tail_masks=masks, tail_len=tail_len)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        print("ok")
        """
    )
    run_interpreted(script)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [8, 5])
def test_tail_masks_on_cuda(dtype: torch.dtype, width: int) -> None:
    from kernels.attention_triton import triton_uniform_attention

    (query, keys, values, tables, seq_lens, masks, _), tail_len, _ = _tail_case(dtype, width)
    scale = query.shape[-1] ** -0.5
    args = [t.cuda() for t in (query, keys, values, tables, seq_lens)]
    got = triton_uniform_attention(*args, width, scale, tail_masks=masks.cuda(), tail_len=tail_len)
    want = uniform_attention_reference(*args, width, scale, masks.cuda(), tail_len)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("context", [0, 5, 70])
def test_a_tail_of_63_rows_on_cuda(context: int) -> None:
    """The widest tail (63 rows, the tree loop's deepest: eight new rows seeing the 55 before
    them by their bits): the last tile's keys past seq_len would have bits of 64 and more, a
    shift the kernel must never make; every row as the reference (which clamps) has it."""
    from kernels.attention_triton import triton_uniform_attention

    width, tail_len, head_dim = 8, 63, 16
    gen = torch.Generator().manual_seed(context)
    shape = (60, 16, NUM_KV_HEADS, head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    seq_lens = torch.tensor([context + tail_len])
    tables = torch.randperm(60, generator=gen)[:12].view(1, 12)
    query = torch.randn(width, NUM_HEADS, head_dim, generator=gen)
    first = tail_len - width
    masks = torch.tensor([[(1 << (first + j + 1)) - 1 for j in range(width)]])
    args = [t.cuda() for t in (query, keys, values, tables, seq_lens)]
    scale = head_dim**-0.5
    got = triton_uniform_attention(*args, width, scale, tail_masks=masks.cuda(), tail_len=tail_len)
    want = uniform_attention_reference(*args, width, scale, masks.cuda(), tail_len)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)


def test_flash_attention_hands_a_tree_forward_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn masks causally only: a forward with a tree's rows is SDPA's, whole (a fake
    flash module here, which would fail the test if called), and gives SDPA's answer."""
    import types

    from kernels import attention_flash

    def never(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("flash-attn was asked to attend a tree")

    fake = types.SimpleNamespace(__name__="vllm_flash_attn", flash_attn_varlen_func=never)
    monkeypatch.setattr(attention_flash, "_load_flash_module", lambda: fake)
    flash = attention_flash.FlashAttention()
    key_cache, value_cache = _cache(torch.float32, 16, 0)
    lens = [(3, 13), (1 + len(PARENTS), 9 + 1 + len(PARENTS))]
    tables = [scattered_block_ids(s, BLOCK, 40, seed) for seed, (_, s) in enumerate(lens)]
    meta = _metadata(lens, {1: tree_of(9, PARENTS)}, tables)
    query = torch.randn(meta.num_tokens, NUM_HEADS, 16, generator=torch.Generator().manual_seed(1))
    got = flash.forward(query, key_cache, value_cache, flash.prepare(meta), 0.25)
    sdpa = SdpaAttention()
    want = sdpa.forward(query, key_cache, value_cache, sdpa.prepare(meta), 0.25)
    assert torch.equal(got, want)
