"""Block allocator (refcounts), block tables (copy-on-write, rollback), cache tensors."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.factories import tiny_config
from workers.kv_cache import (
    BlockAllocator,
    BlockTable,
    NoFreeBlocksError,
    PagedKVCache,
    block_hashes,
)


def test_allocate_and_free_round_trip() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(3)
    assert len(set(blocks)) == 3 and alloc.num_free_blocks == 1
    assert all(alloc.refcount(b) == 1 for b in blocks)
    alloc.free(blocks)
    assert alloc.num_free_blocks == 4


def test_allocation_is_all_or_nothing() -> None:
    alloc = BlockAllocator(2)
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate(3)
    assert alloc.num_free_blocks == 2


def test_shared_block_stays_until_last_holder_frees_it() -> None:
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.share([b])
    alloc.free([b])
    assert alloc.num_free_blocks == 1 and alloc.refcount(b) == 1
    alloc.free([b])
    assert alloc.num_free_blocks == 2


def test_double_free_and_sharing_a_free_block_are_errors() -> None:
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        alloc.free([b])
    with pytest.raises(ValueError, match="is free"):
        alloc.share([b])


def test_block_table_grows_maps_slots_and_truncates() -> None:
    alloc = BlockAllocator(8)
    table = BlockTable(alloc, block_size=4)
    assert table.prepare_write(0, 6) == []
    assert len(table.block_ids) == 2
    b0, b1 = table.block_ids
    assert table.slots(3, 6) == [b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    table.truncate(4)  # roll back to exactly one full block
    assert table.block_ids == [b0] and alloc.num_free_blocks == 7
    table.release()
    assert alloc.num_free_blocks == 8


def test_fork_shares_blocks_and_copy_on_write_privatizes_the_written_one() -> None:
    alloc = BlockAllocator(8)
    parent = BlockTable(alloc, block_size=4)
    parent.prepare_write(0, 6)  # one full block, one half-full
    child = parent.fork()
    assert child.block_ids == parent.block_ids
    assert all(alloc.refcount(b) == 2 for b in parent.block_ids)
    copies = child.prepare_write(6, 7)  # writes into the shared second block
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent.block_ids[1] and child.block_ids == [parent.block_ids[0], dst]
    assert alloc.refcount(src) == 1 and alloc.refcount(dst) == 1
    assert alloc.refcount(parent.block_ids[0]) == 2  # the untouched prefix stays shared


def test_prepare_write_changes_nothing_when_blocks_run_out() -> None:
    alloc = BlockAllocator(2)
    table = BlockTable(alloc, block_size=2)
    table.prepare_write(0, 4)
    with pytest.raises(NoFreeBlocksError):
        table.prepare_write(4, 5)
    assert len(table.block_ids) == 2 and alloc.num_free_blocks == 0


def test_paged_cache_shapes_sizing_and_block_copy() -> None:
    config = tiny_config()
    per_block = PagedKVCache.bytes_per_block(config, 4, torch.float32)
    cache = PagedKVCache.for_memory(config, per_block * 5 + 1, 4, torch.float32)
    assert cache.num_blocks == 5 and cache.nbytes == per_block * 5
    key, value = cache.layers[1]
    assert key.shape == (5, 4, config.num_kv_heads, config.head_dim)
    key[2].fill_(3.0)
    value[2].fill_(-3.0)
    cache.copy_blocks([(2, 4)])
    assert torch.equal(key[4], key[2]) and torch.equal(value[4], value[2])
    with pytest.raises(ValueError, match="hold no KV block"):
        PagedKVCache.for_memory(config, per_block - 1, 4, torch.float32)


def test_block_hashes_chain_over_the_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = block_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3  # only full blocks
    assert a[0] != b[0] and a[1] != b[1]  # same tokens after a different prefix differ
    assert block_hashes([1, 2, 3, 4], 2) == a[:2]


def test_block_hashes_are_blake2b_of_the_parent_and_tokens_little_endian() -> None:
    """The chain's definition, hash by hash (stable across processes and versions): blake2b
    (8 bytes) of the parent's 8 little-endian bytes and each token's 4."""
    tokens, parent = [0, 1, 49151, 2**32 - 1, 7, 300_000], 2**64 - 5
    expected = []
    for start in (0, 3):
        digest = hashlib.blake2b(digest_size=8)
        digest.update(parent.to_bytes(8, "little"))
        for token in tokens[start : start + 3]:
            digest.update(token.to_bytes(4, "little"))
        parent = int.from_bytes(digest.digest(), "little")
        expected.append(parent)
    assert block_hashes(tokens, 3, 2**64 - 5) == expected


def test_prefix_cache_reuses_and_revives_blocks() -> None:
    alloc = BlockAllocator(6)
    tokens = list(range(10))  # 2 full blocks of 4, and 2 tokens
    first = BlockTable(alloc, 4)
    first.prepare_write(0, 10)
    first.cache_full_blocks(tokens, num_computed_tokens=10)
    assert alloc.num_cached_blocks == 2
    second = BlockTable(alloc, 4)
    assert second.use_cached_prefix([*tokens, 99]) == 8
    assert second.block_ids == first.block_ids[:2]
    assert alloc.refcount(first.block_ids[0]) == 2
    first.release()
    second.release()
    assert alloc.num_free_blocks == 6 and alloc.num_cached_blocks == 2  # freed, still cached
    third = BlockTable(alloc, 4)
    assert third.use_cached_prefix(tokens) == 8  # revived from the free list
    assert alloc.num_free_blocks == 4


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    alloc = BlockAllocator(3)
    old, new = BlockTable(alloc, 2), BlockTable(alloc, 2)
    old.prepare_write(0, 2)
    old.cache_full_blocks([1, 2], 2)
    new.prepare_write(0, 2)
    new.cache_full_blocks([3, 4], 2)
    old.release()
    new.release()
    alloc.allocate(2)  # the never-used block, then the least recently freed cached one
    assert BlockTable(alloc, 2).use_cached_prefix([1, 2]) == 0
    assert BlockTable(alloc, 2).use_cached_prefix([3, 4]) == 2


def test_truncate_forgets_hashes_of_blocks_no_longer_full() -> None:
    alloc = BlockAllocator(4)
    table = BlockTable(alloc, 2)
    table.prepare_write(0, 6)
    table.cache_full_blocks([1, 2, 3, 4, 5, 6], 6)
    table.truncate(3)
    assert len(table.block_hashes) == 1 and len(table.block_ids) == 2
