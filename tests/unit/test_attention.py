"""Paged attention against a plain-torch reference over contiguous keys and values."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import native
from kernels.attention import (
    MAX_BATCHED_QUERY_LEN,
    AttentionMetadata,
    NativeCpuAttention,
    SdpaAttention,
    causal_mask,
    write_kv,
)
from kernels.attention_flash import (
    FlashAttention,
    flash_attention_available,
    select_attention_backend,
)
from tests.factories import scattered_block_ids

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [q_len, H, D] against the whole context k, v [s_len, KVH, D]; causal, end-aligned."""
    q_len, s_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    allowed = torch.arange(s_len)[None, :] <= (s_len - q_len + torch.arange(q_len))[:, None]
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def build_case(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 7
    # Slots no sequence owns hold large garbage: attending to any of them shows in the output.
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    key_cache = (torch.randn(shape, generator=gen) * 30).to(dtype)
    value_cache = (torch.randn(shape, generator=gen) * 30).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, contexts, queries, slots = [], [], [], []
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        n = -(-s_len // block_size)
        blocks, perm = perm[:n], perm[n:]
        tables.append(blocks)
        k = torch.randn(s_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(s_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        contexts.append((k, v))
        seq_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(s_len)]
        )
        write_kv(key_cache, value_cache, k, v, seq_slots)
        queries.append(torch.randn(q_len, NUM_HEADS, head_dim, generator=gen).to(dtype))
        slots.append(seq_slots[s_len - q_len :])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        block_size=block_size,
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.cat(slots),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return torch.cat(queries), key_cache, value_cache, meta, contexts, torch.cat(slots)


def expected_output(
    query: torch.Tensor, meta: AttentionMetadata, contexts: list, scale: float
) -> torch.Tensor:
    starts = meta.query_start_loc.tolist()
    parts = [
        reference_attention(query[starts[i] : starts[i + 1]], k, v, scale)
        for i, (k, v) in enumerate(contexts)
    ]
    return torch.cat(parts)


CASES = [
    ([1], [1], 4),  # first token of a sequence
    ([1], [37], 16),  # plain decode
    ([6], [40], 4),  # verification of 5 draft tokens
    ([40], [40], 8),  # whole prompt prefill (long: its own SDPA call)
    ([1, 5, 1, 3], [9, 33, 17, 3], 4),  # decodes and verifications padded together
    ([1, 40, 5, 1, MAX_BATCHED_QUERY_LEN + 1], [50, 70, 12, 2, 30], 16),  # mixed with prefills
    ([17, 1, 33], [60, 20, 33], 8),  # verifying 16 drafts beside a 33-token prompt chunk
]


@pytest.mark.parametrize("whole_blocks", [True, False])
@pytest.mark.parametrize(("query_lens", "seq_lens", "block_size"), CASES)
def test_sdpa_matches_reference(
    query_lens: list[int], seq_lens: list[int], block_size: int, whole_blocks: bool
) -> None:
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        query_lens, seq_lens, block_size, torch.float32
    )
    backend = SdpaAttention(whole_blocks=whole_blocks)
    scale = HEAD_DIM**-0.5
    out = backend.forward(query, key_cache, value_cache, backend.prepare(meta), scale)
    torch.testing.assert_close(
        out, expected_output(query, meta, contexts, scale), rtol=1e-5, atol=1e-5
    )


def test_sdpa_bfloat16_close_to_reference() -> None:
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        [1, 5, 30], [20, 25, 30], 8, torch.bfloat16
    )
    backend = SdpaAttention()
    out = backend.forward(query, key_cache, value_cache, backend.prepare(meta), 0.25)
    torch.testing.assert_close(
        out, expected_output(query, meta, contexts, 0.25), rtol=2e-2, atol=2e-2
    )


@pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)]
)
@pytest.mark.parametrize(("query_lens", "seq_lens", "block_size"), CASES)
def test_native_cpu_attention_matches_reference(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    head_dim: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 and fp32: the C kernel serves every sequence, prefill chunks too (reading the
    blocks in place, garbage in every slot nobody owns), within the dtype's rounding of the
    reference, and each sequence's rows are what it computes alone."""
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        query_lens, seq_lens, block_size, dtype, head_dim=head_dim
    )
    # The model hands the backend its query as a view of the fused Q/K rows: strided tokens.
    fused = torch.cat([query, query[:, :2]], dim=1)
    query = fused[:, : query.shape[1]]
    served: list[int] = []
    real = native.paged_attention

    def spy(q: torch.Tensor, *args: object) -> None:
        served.append(int(args[3].shape[0]))  # type: ignore[attr-defined]
        real(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "paged_attention", spy)
    backend = NativeCpuAttention()
    scale = head_dim**-0.5
    plan = backend.prepare(meta)
    out = backend.forward(query, key_cache, value_cache, plan, scale)
    again = backend.forward(query, key_cache, value_cache, plan, scale)  # the next layer
    expected = expected_output(query, meta, contexts, scale)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected.double(), rtol=tolerance, atol=tolerance)
    assert torch.equal(out, again)
    assert served == [len(query_lens)] * 2  # every sequence, prefill chunks too
    # Each sequence's rows are the same whatever else is in the batch.
    if len(query_lens) > 1:
        starts = meta.query_start_loc.tolist()
        for i, q_len in enumerate(query_lens):
            alone = AttentionMetadata(
                block_size=block_size,
                query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
                seq_lens=meta.seq_lens[i : i + 1],
                block_tables=meta.block_tables[i : i + 1],
                slot_mapping=meta.slot_mapping[starts[i] : starts[i + 1]],
                query_lens_host=(q_len,),
                seq_lens_host=(seq_lens[i],),
            )
            rows = query[starts[i] : starts[i + 1]]
            solo = backend.forward(rows, key_cache, value_cache, backend.prepare(alone), scale)
            assert torch.equal(solo, out[starts[i] : starts[i + 1]])


@pytest.mark.skipif(not native.available(), reason="no native CPU kernels here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_of_a_verified_token_is_its_decode_step_bit_for_bit(
    threads: int, dtype: torch.dtype
) -> None:
    """The kernel takes a sequence's new tokens and the query heads of a KV head together in
    tiles (which depend on the batch and the thread count); each token's rows must still be
    exactly what a decode step of that token alone (the keys up to it) computes, or speculative
    output would drift from plain decoding."""
    query_lens, seq_lens = [17, 6, 1], [60, 20, 33]
    query, key_cache, value_cache, meta, _, _ = build_case(
        query_lens, seq_lens, 8, dtype, seed=3, head_dim=64
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        backend = NativeCpuAttention()
        out = backend.forward(query, key_cache, value_cache, backend.prepare(meta), 0.125)
        starts = meta.query_start_loc.tolist()
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            for j in range(q_len):
                row = starts[i] + j
                step = AttentionMetadata(
                    block_size=8,
                    query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                    seq_lens=torch.tensor([s_len - q_len + j + 1], dtype=torch.int32),
                    block_tables=meta.block_tables[i : i + 1],
                    slot_mapping=meta.slot_mapping[row : row + 1],
                    query_lens_host=(1,),
                    seq_lens_host=(s_len - q_len + j + 1,),
                )
                decode = backend.forward(
                    query[row : row + 1], key_cache, value_cache, backend.prepare(step), 0.125
                )
                assert torch.equal(decode[0], out[row]), (i, j)
    finally:
        torch.set_num_threads(before)


def test_native_cpu_attention_is_sdpa_where_its_kernel_cannot_run() -> None:
    """fp16, or a head size the kernel does not take: the SDPA answer, exactly."""
    for dtype, head_dim in ((torch.float16, 64), (torch.bfloat16, HEAD_DIM)):
        query, key_cache, value_cache, meta, _, _ = build_case(
            [1, 5, 40], [20, 25, 40], 8, dtype, head_dim=head_dim
        )
        ours, sdpa = NativeCpuAttention(), SdpaAttention()
        out = ours.forward(query, key_cache, value_cache, ours.prepare(meta), 0.3)
        plan = sdpa.prepare(meta)
        assert torch.equal(out, sdpa.forward(query, key_cache, value_cache, plan, 0.3))


def test_masked_calls_attend_over_whole_blocks() -> None:
    # A lone one-token query needs no mask and keeps its exact length; every masked call reads
    # whole blocks (the CPU kernel's fast key lengths), its keys past each end masked out.
    _, _, _, meta, _, _ = build_case([1, 40, 5, 3], [37, 45, 12, 9], 16, torch.float32)
    plan = SdpaAttention().prepare(meta)
    assert [(g.num_seqs, g.kv_len) for g in plan] == [(1, 48), (3, 48)]
    assert plan[0].mask is not None and not plan[0].mask[0, 0, :, 45:].any()
    (lone,) = SdpaAttention().prepare(build_case([1], [37], 16, torch.float32)[3])
    assert (lone.kv_len, lone.mask) == (37, None)
    exact = SdpaAttention(whole_blocks=False).prepare(meta)
    assert [g.kv_len for g in exact] == [45, 37]


def test_write_kv_places_tokens_in_their_slots() -> None:
    cache_k = torch.zeros(4, 2, 1, 1)
    cache_v = torch.zeros(4, 2, 1, 1)
    key = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    write_kv(cache_k, cache_v, key, -key, torch.tensor([7, 0, 3]))
    assert cache_k.flatten().tolist() == [2, 0, 0, 3, 0, 0, 0, 1]
    assert cache_v.flatten().tolist() == [-2, 0, 0, -3, 0, 0, 0, -1]


def test_causal_mask_is_end_aligned_and_pads_safely() -> None:
    mask = causal_mask([2, 1], [4, 2], max_query_len=2, kv_len=4, device=torch.device("cpu"))
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    # Sequence 1: one real query seeing its 2 keys; the padding query sees key 0 only.
    assert mask[1, 0].tolist() == [[True, True, False, False], [True, False, False, False]]


def test_metadata_rejects_inconsistent_lengths() -> None:
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata(
            block_size=4,
            query_start_loc=torch.tensor([0, 5]),
            seq_lens=torch.tensor([3]),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(5, dtype=torch.long),
            query_lens_host=(5,),
            seq_lens_host=(3,),
        )


def test_backend_selection_falls_back_to_sdpa_on_cpu() -> None:
    assert isinstance(select_attention_backend(torch.device("cpu"), torch.bfloat16), SdpaAttention)
    with pytest.raises(RuntimeError, match="not available"):
        select_attention_backend(torch.device("cpu"), torch.float32, prefer="flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend(torch.device("cpu"), torch.float32, prefer="xformers")


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available()
    or not flash_attention_available(torch.device("cuda"), torch.bfloat16, block_size=256),
    reason="needs CUDA and vllm_flash_attn or flash_attn",
)
@pytest.mark.parametrize(("query_lens", "seq_lens"), [c[:2] for c in CASES])
def test_flash_matches_reference_on_cuda(query_lens: list[int], seq_lens: list[int]) -> None:
    flash = FlashAttention()
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        query_lens, seq_lens, flash.block_multiple, torch.bfloat16
    )
    meta_cuda = on_cuda(meta)
    args = (query.cuda(), key_cache.cuda(), value_cache.cuda())
    out = flash.forward(*args, flash.prepare(meta_cuda), 0.25)
    expected = expected_output(query, meta, contexts, 0.25)
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-2, atol=2e-2)


def on_cuda(meta: AttentionMetadata) -> AttentionMetadata:
    cuda = torch.device("cuda")
    return AttentionMetadata(
        block_size=meta.block_size,
        query_start_loc=meta.query_start_loc.to(cuda),
        seq_lens=meta.seq_lens.to(cuda),
        block_tables=meta.block_tables.to(cuda),
        slot_mapping=meta.slot_mapping.to(cuda),
        query_lens_host=meta.query_lens_host,
        seq_lens_host=meta.seq_lens_host,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("query_lens", "seq_lens", "block_size"), CASES)
def test_sdpa_matches_reference_on_cuda(
    query_lens: list[int], seq_lens: list[int], block_size: int, dtype: torch.dtype
) -> None:
    """SDPA on CUDA, grouped heads under a mask included (each query head given its group's
    keys, so that a CUDA kernel rather than torch's math backend serves the call)."""
    query, key_cache, value_cache, meta, contexts, _ = build_case(
        query_lens, seq_lens, block_size, dtype
    )
    backend = SdpaAttention()
    args = (query.cuda(), key_cache.cuda(), value_cache.cuda())
    out = backend.forward(*args, backend.prepare(on_cuda(meta)), 0.25)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    expected = expected_output(query, meta, contexts, 0.25)
    torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol)


def test_scattered_block_ids_helper_gives_distinct_blocks() -> None:
    ids = scattered_block_ids(33, 4, 20, seed=3)
    assert len(ids) == 9 and len(set(ids)) == 9
