"""Uniform-batch paged attention as one Triton kernel: decode and verification on a GPU.

The contract is kernels/attention_uniform.py's (every sequence brings `width` new tokens, the
last of a short draft padded). One program serves one sequence and one KV head: it loads the
queries of all the query heads that share that KV head for all `width` new tokens as one tile
of up to ROWS rows, then walks the sequence's context in BLOCK_N keys at a time, reading each
key's slot through the block table inside the kernel, with an online softmax (flash attention's
recurrence). A verify forward of 1 + k tokens therefore reads each key and value once, as a
decode step does, which is what makes verification cost about a decode step.

Everything it reads is a tensor of fixed shape, and its loop bound is read on the device, so
it runs inside a captured CUDA graph. Triton is imported lazily; with `TRITON_INTERPRET=1` the
same kernel runs on the CPU (the tests check it against the torch reference there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.attention_uniform import UniformPlan, uniform_plan
from kernels.fused_triton import triton_available

BLOCK_N = 64  # keys per inner step
MIN_ROWS = 16  # tl.dot's smallest tile


MAX_ROWS = 256  # one program's tile: new tokens x query heads per KV head


def kernel_problem(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    group: int,  # query heads per KV head
    width: int,  # the most new tokens per sequence
    interpret: bool = False,  # under TRITON_INTERPRET=1, where the CPU runs it
) -> str | None:
    """Why the kernel cannot serve a model of this shape (None: it can)."""
    if device.type != "cuda" and not interpret:
        return "the kernel runs on CUDA (or under TRITON_INTERPRET=1)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype} is not supported"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} must be a power of two >= 16"
    if width * group > MAX_ROWS:
        return f"{width} new tokens x {group} query heads per KV head exceed one tile"
    if not triton_available():
        return "triton is not installed"
    return None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def uniform_paged_attention(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        masks_ptr,
        scale,
        stride_q_tok,
        stride_q_head,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        stride_table,
        stride_o_tok,
        stride_o_head,
        width,
        tail_len,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        TREE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, ROWS)
        token = rows // GROUP  # row = token * GROUP + query head within the group
        row_ok = rows < width * GROUP
        head = kv_head * GROUP + rows % GROUP
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (seq * width + token) * stride_q_tok + head * stride_q_head
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        seq_len = tl.load(seq_lens_ptr + seq)
        position = seq_len - width + token  # [ROWS]
        tail = seq_len - tail_len
        if TREE:  # each new token's tail mask: which new tokens it sees
            tail_mask = tl.load(masks_ptr + seq * width + token, mask=row_ok, other=0)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < seq_len
            block = tl.load(
                block_tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_ok, other=0
            ).to(tl.int64)
            slot = (
                block * stride_cache_block
                + (keys % BLOCK_SIZE) * stride_cache_slot
                + kv_head * stride_cache_head
            )
            k = tl.load(
                k_cache_ptr + slot[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0
            )
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            if TREE:
                # Past seq_len a key's bit would be 64 or more: a shift LLVM leaves undefined.
                in_tail = (keys >= tail) & key_ok
                bit = tl.where(in_tail, keys - tail, 0).to(tl.int64)
                named = ((tail_mask[:, None] >> bit[None, :]) & 1) == 1
                visible = tl.where(keys[None, :] >= tail, named, keys[None, :] < tail)
                visible = visible & key_ok[None, :]
            else:
                visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + slot[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        o_rows = (seq * width + token) * stride_o_tok + head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )

    return uniform_paged_attention


def triton_uniform_attention(
    query: torch.Tensor,  # [num_seqs * width, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64
    width: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_seqs * width, num_heads, head_dim]
    tail_masks: torch.Tensor | None = None,  # [num_seqs, width] int64: a draft tree's step
    tail_len: int = 0,  # rows the masks cover (0: width)
) -> torch.Tensor:
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(
            query.shape[0], num_heads, head_dim, dtype=query.dtype, device=query.device
        )
    rows = max(MIN_ROWS, 1 << (width * group - 1).bit_length())
    _kernel()[(num_seqs, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        seq_lens if tail_masks is None else tail_masks,  # not read without a tree
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        width,
        tail_len or width,
        GROUP=group,
        ROWS=rows,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        IEEE=query.dtype == torch.float32,
        TREE=tail_masks is not None,
        num_warps=4,
    )
    return out


class TritonUniformAttention(AttentionBackend):
    """The Triton kernel as an attention backend for uniform batches (CUDA)."""

    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> UniformPlan:
        return uniform_plan(meta)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: UniformPlan,
        scale: float,
    ) -> torch.Tensor:
        return triton_uniform_attention(
            query,
            key_cache,
            value_cache,
            plan.block_tables,
            plan.seq_lens,
            plan.width,
            scale,
            tail_masks=plan.tail_masks,
            tail_len=plan.tail_len,
        )
