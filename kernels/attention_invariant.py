"""Paged attention whose every query row is computed alike in any forward: `--deterministic`.

The default GPU path attends through three kernels: flash-attn or SDPA for prefill chunks and
mixed batches, the uniform Triton kernel (kernels/attention_triton.py) for decode and
verification, whose tile is sized by the step's width. Each sums a query's keys in its own
order, so a token's attention output, and then its logits, differ in the last bits between a
whole prompt's prefill, a chunk after a prefix-cache hit, a decode step and a verification.

This backend serves every forward with one Triton kernel whose arithmetic per query row is
fixed by the model's shape alone:
- a program takes BLOCK_Q new tokens of one sequence times the query heads that share one KV
  head, as a tile of ROWS rows (fixed per model, padded; never sized by the batch or width);
- it walks the sequence's keys BLOCK_N at a time from key 0, so the key tiles a query meets are
  those of its position, whatever chunk, step or batch brought it; a tile wholly after a row's
  position leaves that row's running max, sum and output unchanged (its scores are -inf);
- the online softmax (flash attention's recurrence) runs in fp32 per row.

One kernel, two ways to find the queries: a varlen forward (`uniform=False`, the model's eager
forwards: prefill chunks beside decodes) reads `query_start_loc`; a uniform one (`uniform=True`,
the graph runner's captured decode and verify steps) has sequence i's `width` tokens at rows
`i * width`. Both compute a row alike, so a token's output is the same in a captured step and in
an eager one.

Draft trees are refused: a node sees its ancestors spread over the tree's rows, so its sum runs
over other key tiles than the same token's in a chain. Runs on CUDA, or on the CPU under
`TRITON_INTERPRET=1` (tests/unit/test_batch_invariant.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.batch_invariant import interpreting
from kernels.fused_triton import triton_available

BLOCK_N = 64  # keys per inner step, aligned to key 0
MIN_ROWS = 64  # a program's tile of query rows: new tokens x query heads of one KV head


def tile_rows(group: int) -> tuple[int, int]:
    """(rows in a program's tile, new tokens it takes) for `group` query heads per KV head."""
    rows = max(MIN_ROWS, 1 << (group - 1).bit_length())
    return rows, rows // group


@dataclass(frozen=True, slots=True)
class InvariantPlan:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (read only when not uniform)
    seq_lens: torch.Tensor  # [num_seqs] int32/int64, context including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32/int64
    max_query_len: int  # uniform: every sequence's width


def kernel_problem(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int
) -> str | None:
    """Why the kernel cannot serve a model of this shape (None: it can)."""
    if device.type != "cuda" and not interpreting():
        return "the batch-invariant kernels run on CUDA (or under TRITON_INTERPRET=1)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype} is not supported"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} must be a power of two >= 16"
    if group > 256:
        return f"{group} query heads per KV head exceed one tile"
    if not triton_available():
        return "triton is not installed"
    return None


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def invariant_paged_attention(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, block_tables_ptr,
        seq_lens_ptr, scale, stride_q_tok, stride_q_head, stride_cache_block, stride_cache_slot,
        stride_cache_head, stride_table, stride_o_tok, stride_o_head, width,
        UNIFORM: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        first = tl.program_id(1) * BLOCK_Q  # the tile's first new token of the sequence
        kv_head = tl.program_id(2)
        if UNIFORM:
            q_start = seq * width
            q_len = width
        else:
            q_start = tl.load(query_start_ptr + seq)
            q_len = tl.load(query_start_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, ROWS)
        token = first + rows // GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
        head = kv_head * GROUP + rows % GROUP
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + token) * stride_q_tok + head * stride_q_head
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        position = seq_len - q_len + token  # [ROWS]
        # Keys up to the tile's last position; none where the tile holds no token.
        end = tl.minimum(seq_len - q_len + first + BLOCK_Q, seq_len)
        end = tl.where(first < q_len, end, 0)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for start in range(0, end, BLOCK_N):
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
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows saw no key
        o_rows = (q_start + token) * stride_o_tok + head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )

    return invariant_paged_attention


def invariant_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: InvariantPlan,
    scale: float,
    uniform: bool,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    why = kernel_problem(query.device, query.dtype, head_dim, group)
    if why is not None:
        raise ValueError(why)
    rows, block_q = tile_rows(group)
    num_seqs = plan.block_tables.shape[0]
    out = torch.empty_like(query)
    grid = (num_seqs, -(-plan.max_query_len // block_q), num_kv_heads)
    _kernel()[grid](
        query,
        key_cache,
        value_cache,
        out,
        plan.query_start_loc,
        plan.block_tables,
        plan.seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        plan.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        plan.max_query_len,
        UNIFORM=uniform,
        GROUP=group,
        ROWS=rows,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        IEEE=query.dtype == torch.float32,
        num_warps=4,
    )
    return out


class InvariantAttention(AttentionBackend):
    """The kernel as an attention backend: `uniform=True` for the graph runner's steps (every
    sequence `width` new tokens; `query_start_loc` is not read), False for any other forward."""

    def __init__(self, uniform: bool = False) -> None:
        self.uniform = uniform
        self.name = "invariant-uniform" if uniform else "invariant"

    def prepare(self, meta: AttentionMetadata) -> InvariantPlan:
        if meta.tree is not None or meta.tail_masks is not None:
            raise ValueError(
                "batch-invariant attention takes no draft trees (a node's keys are not its "
                "chain's tiles): draft chains with --deterministic"
            )
        if self.uniform and len(set(meta.query_lens_host)) != 1:
            raise ValueError("a uniform batch needs one query length")
        return InvariantPlan(
            meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len
        )

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: InvariantPlan,
        scale: float,
    ) -> torch.Tensor:
        return invariant_attention(query, key_cache, value_cache, plan, scale, self.uniform)
