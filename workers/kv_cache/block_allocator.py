"""Fixed-size KV blocks handed out by reference count, with prefix caching by block hash.

A full block whose keys and values are computed can be registered under the hash of its tokens
(chained with the hash of everything before it, so equal hashes mean equal prefixes). When its
last holder frees it, the block keeps its hash and waits in the free list, least recently freed
first; a later sequence with the same prefix revives it instead of recomputing, and only an
allocation that needs the space evicts it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """The cache has fewer free blocks than a request needs right now."""


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hashes of every full block of `token_ids` (stable across processes)."""
    hashes = []
    layout = struct.Struct(f"<Q{block_size}I")  # the parent's 8 bytes, each token's 4
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = layout.pack(parent, *token_ids[start : start + block_size])
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """Block ids `0..num_blocks-1`; a block is free again once its last holder frees it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refcounts = [0] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks, each held once; all or nothing. Evicts cached blocks."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for b in blocks:
            self._refcounts[b] = 1
            self._forget(b)
        return blocks

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (a sequence reusing a prefix, or a fork)."""
        for b in block_ids:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refcounts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one hold on each block; blocks nobody holds become free (keeping their hash)."""
        for b in block_ids:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was held")
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free[b] = None

    def register(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` holds the full block whose chained hash is `block_hash`."""
        if self._refcounts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free and cannot be registered")
        if block_hash in self._hash_to_block or block_id in self._block_to_hash:
            return  # an equal block is cached already, or this one is registered
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash

    def num_cached(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached (holds nothing; a hint only: another
        thread may evict them before they are adopted)."""
        n = 0
        for h in hashes:
            if h not in self._hash_to_block:
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Hold the cached blocks of the longest prefix of `hashes` that is cached."""
        blocks = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        for b in blocks:
            if self._refcounts[b] == 0:
                del self._free[b]  # revived from the free list
            self._refcounts[b] += 1
        return blocks

    def _forget(self, block_id: int) -> None:
        block_hash = self._block_to_hash.pop(block_id, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
