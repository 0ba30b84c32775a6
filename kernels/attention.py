"""Paged attention: one contract, three implementations.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`
(the layout vllm-flash-attn reads). A forward brings a flattened batch of new tokens: sequence `i`
owns rows `query_start_loc[i]:query_start_loc[i + 1]` of the query, and its context (cached tokens
plus the new ones, `seq_lens[i]` in all) lives in the blocks its row of `block_tables` names.
New token `j` of a sequence sits at position `seq_lens[i] - query_len + j` and sees every context
position up to and including its own (causal, aligned to the end of the context), unless it
belongs to a draft tree (`AttentionMetadata.tree`: kernels/tree_attention.py).

`SdpaAttention` runs anywhere torch does; `NativeCpuAttention` is the same with our C kernel
(kernels/native.py) for decode and verification in bf16 on CPUs that run it; `FlashAttention`
(kernels/attention_flash.py) calls the paged flash-attn kernel on CUDA. All take an
`AttentionMetadata`, are prepared once per forward (`prepare`), then called once per layer
(`forward`), and give the same answer (tests/unit/test_attention.py).
"""

from __future__ import annotations

import contextlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import native
from kernels.tree_attention import TreeRows, gathered_tree_rows, native_tree_rows

# Sequences with more new tokens than this get their own SDPA call instead of being padded into
# the shared decode/verify group (padding a prefill chunk's length onto every decode would waste
# far more than a Python call costs).
MAX_BATCHED_QUERY_LEN = 16
# The SDPA backends a CUDA call may use. Left to itself, torch 2.11 picks cuDNN's attention for
# masked calls on an H100, which builds a graph for every new shape: a decode group's key length
# grows each step, and the call cost ~0.45 ms of host time (all 30 layers: most of a step; see
# docs/design.md, Devices). The others plan nothing per shape.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flattened batch and in the paged cache."""

    block_size: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token's K/V
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # The rows of draft trees, which see listed keys rather than all before them
    # (kernels/tree_attention.py); None: every sequence is causal.
    tree: TreeRows | None = None
    # A uniform batch's draft trees (kernels/attention_uniform.py): `[num_seqs, width]` int64,
    # bit i of new token j's mask set where it sees row i of the tail (its last `tail_len`
    # rows, 0: the new tokens); None: causal.
    tail_masks: torch.Tensor | None = None
    tail_len: int = 0

    def __post_init__(self) -> None:
        if len(self.query_lens_host) != len(self.seq_lens_host):
            raise ValueError("query_lens_host and seq_lens_host need one entry per sequence")
        for q_len, s_len in zip(self.query_lens_host, self.seq_lens_host, strict=True):
            if not 1 <= q_len <= s_len:
                raise ValueError(f"each sequence needs 1 <= query_len <= seq_len: {q_len}, {s_len}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def query_starts_host(self) -> list[int]:
        """`query_start_loc` from the host's query lengths (reading the tensor back would
        wait for the device)."""
        return [0, *itertools.accumulate(self.query_lens_host)]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store the new tokens' keys and values in their cache slots."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class AttentionBackend(ABC):
    """Attention over a paged KV cache for a flattened batch of new tokens."""

    name: str
    serves_trees = False  # whether it attends draft trees' rows (`AttentionMetadata.tree`)

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> Any:
        """Work shared by every layer of one forward (index tensors, masks)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention output for every new token."""


@dataclass(frozen=True, slots=True)
class _SdpaGroup:
    """Sequences answered by one SDPA call, padded to a common query and key length."""

    num_seqs: int
    max_query_len: int
    kv_len: int  # keys per sequence after gathering its blocks
    block_tables: torch.Tensor  # [num_seqs, num_blocks] blocks to gather per sequence
    mask: torch.Tensor | None  # [num_seqs, 1, max_query_len, kv_len] bool, True = attend
    token_slice: slice  # output rows of a lone sequence (used when query_rows is None)
    query_rows: torch.Tensor | None  # [num_seqs * max_query_len] flat query rows to gather
    out_rows: torch.Tensor | None  # [num_group_tokens] padded rows that hold real tokens
    token_rows: torch.Tensor | None  # [num_group_tokens] where those rows go in the output


def causal_mask(
    query_lens: list[int],
    seq_lens: list[int],
    max_query_len: int,
    kv_len: int,
    device: torch.device,
) -> torch.Tensor:  # [num_seqs, 1, max_query_len, kv_len] bool
    """Bottom-right aligned causal mask over padded queries and keys."""
    q_len = torch.tensor(query_lens, device=device).view(-1, 1, 1)
    s_len = torch.tensor(seq_lens, device=device).view(-1, 1, 1)
    i = torch.arange(max_query_len, device=device).view(1, -1, 1)
    j = torch.arange(kv_len, device=device).view(1, 1, -1)
    visible = (j <= s_len - q_len + i) & (j < s_len)
    # A padding query (i >= q_len) sees key 0 only, so its softmax stays finite; it is dropped.
    visible = torch.where(i < q_len, visible, j == 0)
    return visible.unsqueeze(1)


class SdpaAttention(AttentionBackend):
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`.

    Short queries (decode, verification of a draft) share one padded SDPA call; each long query
    (a prefill chunk) gets its own. Keys and values are gathered from the cache blocks first.

    Under a mask (anything but a lone one-token query) the call attends over the whole gathered
    blocks, the keys past each sequence's end masked out: torch's CPU kernel runs up to 2x
    slower on key lengths that are not a multiple of 16 (tests/benchmarks/bench_forward.py
    measures it). `whole_blocks=False` keeps the exact lengths, for that comparison.
    """

    name = "sdpa"
    serves_trees = True

    def __init__(self, whole_blocks: bool = True) -> None:
        self.whole_blocks = whole_blocks

    def prepare(self, meta: AttentionMetadata) -> list[_SdpaGroup | TreeRows]:
        starts = meta.query_starts_host
        lens = meta.query_lens_host
        in_tree = meta.tree.seqs if meta.tree is not None else frozenset()
        causal = [i for i in range(len(lens)) if i not in in_tree]
        short = [i for i in causal if lens[i] <= MAX_BATCHED_QUERY_LEN]
        groups: list[_SdpaGroup | TreeRows] = [
            self._group(meta, starts, [i]) for i in causal if lens[i] > MAX_BATCHED_QUERY_LEN
        ]
        if short:
            groups.append(self._group(meta, starts, short))
        if meta.tree is not None:
            groups.append(meta.tree)
        return groups

    def _group(self, meta: AttentionMetadata, starts: list[int], seqs: list[int]) -> _SdpaGroup:
        device = meta.block_tables.device
        query_lens = [meta.query_lens_host[i] for i in seqs]
        seq_lens = [meta.seq_lens_host[i] for i in seqs]
        max_q, kv_len = max(query_lens), max(seq_lens)
        num_blocks = -(-kv_len // meta.block_size)
        rows = torch.tensor(seqs, device=device)
        block_tables = meta.block_tables.index_select(0, rows)[:, :num_blocks]
        lone = len(seqs) == 1
        mask = None
        if not (lone and max_q == 1):
            if self.whole_blocks:
                kv_len = num_blocks * meta.block_size
            mask = causal_mask(query_lens, seq_lens, max_q, kv_len, device)
        if lone:
            span = slice(starts[seqs[0]], starts[seqs[0] + 1])
            return _SdpaGroup(1, max_q, kv_len, block_tables, mask, span, None, None, None)
        query_rows: list[int] = []
        out_rows: list[int] = []
        token_rows: list[int] = []
        for n, (i, q_len) in enumerate(zip(seqs, query_lens, strict=True)):
            query_rows += [starts[i] + min(j, q_len - 1) for j in range(max_q)]
            out_rows += range(n * max_q, n * max_q + q_len)
            token_rows += range(starts[i], starts[i] + q_len)

        def index(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=device)

        return _SdpaGroup(
            len(seqs),
            max_q,
            kv_len,
            block_tables,
            mask,
            slice(0, 0),
            index(query_rows),
            index(out_rows),
            index(token_rows),
        )

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: list[_SdpaGroup | TreeRows],
        scale: float,
    ) -> torch.Tensor:
        lone = plan[0] if len(plan) == 1 else None
        if isinstance(lone, _SdpaGroup) and lone.query_rows is None:
            return self._attend(query, key_cache, value_cache, lone, scale)
        out = torch.empty_like(query)
        for group in plan:
            if isinstance(group, TreeRows):
                rows = _sdpa(*gathered_tree_rows(query, key_cache, value_cache, group), scale)
                out.index_copy_(0, group.rows, rows.squeeze(2))
            elif group.query_rows is None:
                out[group.token_slice] = self._attend(query, key_cache, value_cache, group, scale)
            else:
                assert group.out_rows is not None and group.token_rows is not None
                padded = self._attend(query, key_cache, value_cache, group, scale)
                out.index_copy_(0, group.token_rows, padded.index_select(0, group.out_rows))
        return out

    @staticmethod
    def _attend(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: _SdpaGroup,
        scale: float,
    ) -> torch.Tensor:  # [num_seqs * max_query_len, num_heads, head_dim]
        b, q_len, kv_len = group.num_seqs, group.max_query_len, group.kv_len
        num_heads, head_dim = query.shape[1], query.shape[2]
        if group.query_rows is None:
            q = query[group.token_slice]
        else:
            q = query.index_select(0, group.query_rows)
        q = q.view(b, q_len, num_heads, head_dim).transpose(1, 2)
        k = _gather(key_cache, group.block_tables, kv_len)
        v = _gather(value_cache, group.block_tables, kv_len)
        gqa = k.shape[1] != num_heads
        if q.is_cuda and gqa and group.mask is not None:
            # Under a mask only the memory-efficient kernel serves a CUDA call, and it takes no
            # grouped heads: torch 2.11 fell back to its math backend (measured on an H200: 0.45
            # ms of host time a layer, half of an eager forward's). Each query head gets its
            # group's keys and values instead.
            group_size = num_heads // k.shape[1]
            k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
            gqa = False
        out = _sdpa(q, k, v, group.mask, scale, gqa)  # [b, num_heads, q_len, head_dim]
        return out.transpose(1, 2).reshape(b * q_len, num_heads, head_dim)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gqa: bool = False,
) -> torch.Tensor:
    """torch's SDPA, on CUDA among the backends that plan nothing per shape."""
    backends = sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


@dataclass(slots=True)
class _NativePlan:
    """What NativeCpuAttention does this forward, settled at its first layer (which shows the
    query's dtype and shape) and kept for the others."""

    meta: AttentionMetadata
    # Once settled, one of: (block tables, query starts, query lengths, sequence lengths) of
    # every sequence for the kernel, or SDPA's groups where the kernel does not serve it.
    native: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    sdpa: list[_SdpaGroup | TreeRows] | None = None


class NativeCpuAttention(SdpaAttention):
    """`SdpaAttention`, except that every sequence attends through our C kernel
    (kernels/native.py), which reads its blocks in place instead of gathering them for SDPA,
    when the query is bf16 or fp32 on a CPU that runs it. The kernel computes each token's
    attention from its own query and keys alone, so with the row-independent projections of
    kernels/native.py a token's logits do not depend on its forward: a decode step, a
    verification of any draft, any batch, a prefill chunk of any split, or the rest of a prompt
    after a prefix-cache hit (speculative decoding commits exactly what decoding does, and a
    request's text does not depend on what ran before it; in fp32 over quantized weights too,
    whose rows are rounded to int8, where SDPA's batch-dependent last bits used to move a
    near-tie). It is also the faster for prefill chunks (a 1,000-token prompt's prefill: 0.32 s
    against SDPA's 0.65 s on the 2-core VM). Other dtypes and other CPUs take the SDPA path
    unchanged."""

    name = "native"

    def prepare(self, meta: AttentionMetadata) -> _NativePlan:  # type: ignore[override]
        return _NativePlan(meta)

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: _NativePlan,
        scale: float,
    ) -> torch.Tensor:
        if plan.native is None and plan.sdpa is None:
            self._settle(plan, query, key_cache, value_cache)
        if plan.native is None:
            assert plan.sdpa is not None
            return super().forward(query, key_cache, value_cache, plan.sdpa, scale)
        out = torch.empty_like(query)
        native.paged_attention(query, key_cache, value_cache, *plan.native, scale, out)
        tree = plan.meta.tree
        if tree is not None:
            out.index_copy_(
                0, tree.rows, native_tree_rows(query, key_cache, value_cache, tree, scale)
            )
        return out

    def native_tables(
        self,
        plan: object,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kernel's (block tables, query starts, query lengths, sequence lengths) for this
        forward, settled now as its first layer would settle them; None where the plan's
        sequences attend through SDPA (workers/model/native_layers.py, which runs a layer in
        one call, asks before its first layer)."""
        if not isinstance(plan, _NativePlan):
            return None
        if plan.native is None and plan.sdpa is None:
            self._settle(plan, query, key_cache, value_cache)
        return plan.native

    def _settle(
        self,
        plan: _NativePlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> None:
        meta = plan.meta
        usable = (
            native.paged_attention_problem(query, key_cache, value_cache) is None
            and native.available()
        )
        if not usable:
            plan.sdpa = super().prepare(meta)
            return

        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        starts: Sequence[int] = meta.query_starts_host[:-1]
        query_lens: Sequence[int] = meta.query_lens_host
        seq_lens: Sequence[int] = meta.seq_lens_host
        tables = meta.block_tables.to(torch.int32)
        if meta.tree is not None:  # the kernel takes the causal ones; a tree's rows one by one
            seqs = [i for i in range(meta.num_seqs) if i not in meta.tree.seqs]
            starts = [starts[i] for i in seqs]
            query_lens = [query_lens[i] for i in seqs]
            seq_lens = [seq_lens[i] for i in seqs]
            tables = tables.index_select(0, torch.tensor(seqs, dtype=torch.long))
        plan.native = (tables.contiguous(), ints(starts), ints(query_lens), ints(seq_lens))


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [b, n]
    kv_len: int,
) -> torch.Tensor:  # [b, num_kv_heads, kv_len, head_dim]
    b, n = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))
    return blocks.view(b, n * block_size, num_kv_heads, head_dim)[:, :kv_len].transpose(1, 2)
