"""Attention for draft trees: rows that see their sequence's cached context, then a list of keys.

A draft tree's nodes are verified in one forward. Node j's K/V goes into the sequence's next
free slot (its row in the forward), its rotary position is the context's end plus its depth, and
it sees the cached context and then its ancestors' keys and its own, in depth order: exactly the
keys, in the order, that the same token would see decoded after its ancestors. A row's keys are
given as a slot table (`TreeRows.slots`: the physical cache slot of each visible key, in order),
so that every backend attends over the same keys as a chain would:

- our C kernel (kernels/native.py) reads the cache as blocks of one slot, each row a sequence
  of one new token whose "block table" is its slot table. The kernel's arithmetic follows the
  keys, not the blocks, so a node's output equals its chain's bit for bit: speculation with
  trees commits what plain decoding does;
- SDPA gathers each row's keys and masks the padding (flash-attn, causal only, hands a forward
  with a tree to SDPA).

The EAGLE head drafts a tree the same way: each depth's nodes see the head's context and their
ancestors written by earlier depths' forwards. The uniform graph backends take trees as tail
masks instead (kernels/attention_uniform.py) and refuse these rows; `serves_trees` says which
backends take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native


@dataclass(frozen=True, slots=True)
class TreeShape:
    """How one sequence's new tokens attend when they are not a chain (see the module
    docstring). Logical rows are positions in the sequence's block table; the new tokens'
    K/V go to rows `num_computed ..` in order, as always."""

    prefix: int  # logical rows 0..prefix-1 every new token sees (the cached context)
    positions: tuple[int, ...]  # each new token's rotary position
    visible: tuple[tuple[int, ...], ...]  # each new token's keys past the prefix, in order

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.visible):
            raise ValueError("a tree shape needs one position and one key list per new token")


def tree_of(num_computed: int, parents: Sequence[int]) -> TreeShape:
    """The shape of a verify step over the last committed token (row 0, at `num_computed`) and
    draft nodes whose parents are `parents` (node i's, -1 for the committed token; parents
    come before their children)."""
    positions = [num_computed]
    visible: list[tuple[int, ...]] = [(num_computed,)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} does not come before it")
        row = parent + 1
        positions.append(positions[row] + 1)
        visible.append((*visible[row], num_computed + 1 + i))
    return TreeShape(num_computed, tuple(positions), tuple(visible))


@dataclass(frozen=True, slots=True)
class TreeRows:
    """The query rows of a forward that belong to trees, with each row's keys."""

    seqs: frozenset[int]  # sequences all of whose rows are here
    rows: torch.Tensor  # [n] int64: the rows in the flattened batch
    slots: torch.Tensor  # [n, max_keys] int32: each row's keys' cache slots, padded with 0
    key_lens: torch.Tensor  # [n] int32
    key_lens_host: tuple[int, ...]


def tree_rows(
    entries: Sequence[tuple[int, int, Sequence[int], TreeShape]],
    block_size: int,
    device: torch.device,
) -> TreeRows:
    """`entries`: (sequence index, its first row in the batch, its block ids, its shape)."""
    tables: list[torch.Tensor] = []
    rows: list[int] = []
    key_lens: list[int] = []
    for _, first, block_ids, shape in entries:
        blocks = torch.tensor(block_ids, dtype=torch.int64)

        def slots_of(logical: torch.Tensor, blocks: torch.Tensor = blocks) -> torch.Tensor:
            return blocks[logical // block_size] * block_size + logical % block_size

        context = slots_of(torch.arange(shape.prefix))
        longest = max(len(v) for v in shape.visible)
        extra = torch.zeros(len(shape.visible), longest, dtype=torch.int64)
        for j, keys in enumerate(shape.visible):
            extra[j, : len(keys)] = slots_of(torch.tensor(keys, dtype=torch.int64))
            key_lens.append(shape.prefix + len(keys))
        tables.append(torch.cat([context.expand(len(shape.visible), -1), extra], dim=1))
        rows += range(first, first + len(shape.visible))
    width = max(t.shape[1] for t in tables)
    slots = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
    return TreeRows(
        seqs=frozenset(seq for seq, _, _, _ in entries),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        slots=slots.to(device=device, dtype=torch.int32),
        key_lens=torch.tensor(key_lens, dtype=torch.int32, device=device),
        key_lens_host=tuple(key_lens),
    )


def native_tree_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    tree: TreeRows,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]: the tree rows' outputs
    """The tree rows' attention through our C kernel (call only where it takes these tensors:
    native.paged_attention_problem), each row a sequence of one token over blocks of one slot."""
    q = query.index_select(0, tree.rows)
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    n = q.shape[0]
    result = torch.empty_like(q)
    native.paged_attention(
        q,
        key_cache.view(-1, 1, kv_heads, head_dim),
        value_cache.view(-1, 1, kv_heads, head_dim),
        tree.slots,
        torch.arange(n, dtype=torch.int32),
        torch.ones(n, dtype=torch.int32),
        tree.key_lens.cpu(),
        scale,
        result,
    )
    return result


def gathered_tree_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    tree: TreeRows,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's inputs for the tree rows: queries `[n, heads, 1, dim]`, each row's keys and
    values `[n, heads, max_keys, dim]` (grouped heads expanded) and the mask of its own keys
    `[n, 1, 1, max_keys]`."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    q = query.index_select(0, tree.rows)
    n, num_heads = q.shape[0], q.shape[1]
    index = tree.slots.long()
    k = key_cache.view(-1, kv_heads, head_dim)[index].transpose(1, 2)
    v = value_cache.view(-1, kv_heads, head_dim)[index].transpose(1, 2)
    if kv_heads != num_heads:
        group = num_heads // kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    keys = torch.arange(index.shape[1], device=q.device)
    mask = (keys[None, :] < tree.key_lens[:, None].to(q.device)).view(n, 1, 1, -1)
    return q.unsqueeze(2), k, v, mask
