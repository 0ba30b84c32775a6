"""Fixed-size KV blocks handed out by reference count, so sequences can share prefix blocks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """The cache has fewer free blocks than a request needs right now."""


class BlockAllocator:
    """Block ids `0..num_blocks-1`; a block is free again once its last holder frees it."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks, each held once; all or nothing."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def share(self, block_ids: Iterable[int]) -> None:
        """One more holder for each block (a sequence reusing a cached prefix, or a fork)."""
        for b in block_ids:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refcounts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one hold on each block; blocks nobody holds become free."""
        for b in block_ids:
            if self._refcounts[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was held")
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
