"""Paged attention over a uniform batch: the shape a CUDA graph captures.

Every sequence brings the same number of new tokens, `width` (decode: 1; verification: 1 + k,
a shorter draft padded at its end), and everything the call reads is a tensor of fixed shape:
the block tables `[num_seqs, max_blocks]` and the context lengths `[num_seqs]` (the cached
tokens plus the `width` new ones). New token j of sequence i sits at cache row
`seq_lens[i] - width + j` and sees every key up to its own row; with tail masks (a draft tree's
step: `AttentionMetadata.tail_masks`, `[num_seqs, width]` int64) it sees every key before the
tail (the last `tail_len` rows: the new tokens by default, or a whole tree drafted over several
forwards) and, of the tail, the rows whose bits its mask sets (its ancestors and itself;
`tail_len` <= 63). A
padded token sees keys that were never written (its own K/V goes to a scratch slot); its output
is garbage that nobody reads, and the real tokens before it never see it.

`UniformTorchAttention` is the plain-torch version: it gathers every block a table can name and
masks, so it reads the whole table's width whatever the context. It runs anywhere (the CPU tests
of the graph path run it) and is the reference of the Triton kernel
(kernels/attention_triton.py), which reads only each context's own blocks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from kernels.attention import CUDA_SDPA_BACKENDS, AttentionBackend, AttentionMetadata

MAX_TREE_WIDTH = 63  # the bits of a tail mask (an int64's, but its sign)


@dataclass(frozen=True, slots=True)
class UniformPlan:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor  # [num_seqs] int32/int64, context including the new tokens
    width: int  # new tokens per sequence
    tail_masks: torch.Tensor | None = None  # [num_seqs, width] int64 (None: causal)
    tail_len: int = 0  # rows the masks' bits cover (0: width)


def uniform_plan(meta: AttentionMetadata) -> UniformPlan:
    if meta.tree is not None:
        raise ValueError("a uniform batch takes its draft trees as tail masks")
    widths = set(meta.query_lens_host)
    if len(widths) != 1:
        raise ValueError(f"a uniform batch needs one query length, got {sorted(widths)}")
    width = widths.pop()
    tail_len = meta.tail_len or width
    if meta.tail_masks is not None and not width <= tail_len <= MAX_TREE_WIDTH:
        raise ValueError(f"tail masks cover {width}..{MAX_TREE_WIDTH} rows, not {tail_len}")
    return UniformPlan(meta.block_tables, meta.seq_lens, width, meta.tail_masks, tail_len)


def causal_tail_masks(width: int) -> list[int]:
    """Each new token's tail mask in a chain: itself and every new token before it."""
    return [(1 << (j + 1)) - 1 for j in range(width)]


class UniformTorchAttention(AttentionBackend):
    """Uniform-batch paged attention in plain torch (see the module docstring)."""

    name = "uniform-torch"

    def prepare(self, meta: AttentionMetadata) -> UniformPlan:
        return uniform_plan(meta)

    def forward(
        self,
        query: torch.Tensor,  # [num_seqs * width, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        plan: UniformPlan,
        scale: float,
    ) -> torch.Tensor:  # [num_seqs * width, num_heads, head_dim]
        return uniform_attention_reference(
            query,
            key_cache,
            value_cache,
            plan.block_tables,
            plan.seq_lens,
            plan.width,
            scale,
            plan.tail_masks,
            plan.tail_len,
        )


def uniform_attention_reference(
    query: torch.Tensor,  # [num_seqs * width, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    width: int,
    scale: float,
    tail_masks: torch.Tensor | None = None,  # [num_seqs, width] int64
    tail_len: int = 0,  # rows the masks cover (0: width)
) -> torch.Tensor:  # [num_seqs * width, num_heads, head_dim]
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    kv_len = max_blocks * block_size
    flat = block_tables.reshape(-1).long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [num_seqs, kv_heads, kv_len, head_dim]
        blocks = cache.index_select(0, flat).view(num_seqs, kv_len, num_kv_heads, head_dim)
        return blocks.transpose(1, 2)

    q = query.reshape(num_seqs, width, num_heads, head_dim).transpose(1, 2)
    positions = seq_lens.long().view(-1, 1) - width + torch.arange(width, device=query.device)
    keys = torch.arange(kv_len, device=query.device)
    mask = keys.view(1, 1, -1) <= positions.unsqueeze(2)  # [num_seqs, width, kv_len]
    if tail_masks is not None:  # the new tokens see the cache and the tail their bits name
        tail = (seq_lens.long() - (tail_len or width)).view(-1, 1, 1)
        bit = (keys.view(1, 1, -1) - tail).clamp(0, MAX_TREE_WIDTH - 1)
        named = (tail_masks.long().unsqueeze(2) >> bit) & 1 == 1
        in_tail = (keys.view(1, 1, -1) >= tail) & (keys.view(1, 1, -1) < seq_lens.view(-1, 1, 1))
        mask = torch.where(in_tail, named, keys.view(1, 1, -1) < tail)
    backends = sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(
            q,
            gather(key_cache),
            gather(value_cache),
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=True,
        )  # [num_seqs, num_heads, width, head_dim]
    return out.transpose(1, 2).reshape(num_seqs * width, num_heads, head_dim)


def select_uniform_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int, group: int, max_width: int
) -> AttentionBackend:
    """The Triton kernel where it can serve this shape (`kernel_problem`: CUDA, Triton, a
    power-of-two head_dim of at least 16, `max_width` x `group` query rows in one tile), else
    the torch reference."""
    from kernels.attention_triton import TritonUniformAttention, kernel_problem

    if kernel_problem(device, dtype, head_dim, group, max_width) is None:
        return TritonUniformAttention()
    return UniformTorchAttention()
