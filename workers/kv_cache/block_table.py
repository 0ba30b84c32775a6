"""One sequence's view of the paged cache: which blocks hold its tokens, in order."""

from __future__ import annotations

from workers.kv_cache.block_allocator import BlockAllocator, NoFreeBlocksError


class BlockTable:
    """The blocks of one sequence. Token `i` lives in slot `block_ids[i // bs] * bs + i % bs`.

    Blocks may be shared with other sequences (refcount > 1); before new tokens are written into
    a shared block, `prepare_write` swaps it for a private copy (copy-on-write) and reports the
    copy the cache must make.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.block_ids: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.block_ids) * self.block_size

    def num_blocks_needed(self, num_tokens: int) -> int:
        """How many more blocks holding `num_tokens` tokens would take."""
        return max(0, -(-num_tokens // self.block_size) - len(self.block_ids))

    def prepare_write(self, start: int, end: int) -> list[tuple[int, int]]:
        """Make slots for tokens `start..end-1` writable; returns (src, dst) block copies to do.

        All or nothing: raises NoFreeBlocksError and changes nothing when blocks are short.
        """
        bs = self.block_size
        touched = range(start // bs, min(-(-end // bs), len(self.block_ids)))
        shared = [i for i in touched if self.allocator.refcount(self.block_ids[i]) > 1]
        new = self.num_blocks_needed(end)
        if new + len(shared) > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {new + len(shared)} KV blocks, {self.allocator.num_free_blocks} free"
            )
        self.block_ids += self.allocator.allocate(new)
        copies: list[tuple[int, int]] = []
        for index in shared:
            block = self.block_ids[index]
            (private,) = self.allocator.allocate(1)
            self.allocator.free([block])
            self.block_ids[index] = private
            copies.append((block, private))
        return copies

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of tokens `start..end-1`."""
        bs = self.block_size
        return [self.block_ids[i // bs] * bs + i % bs for i in range(start, end)]

    def truncate(self, num_tokens: int) -> None:
        """Keep the blocks that hold the first `num_tokens` tokens; free the rest (rollback)."""
        keep = -(-num_tokens // self.block_size)
        self.allocator.free(self.block_ids[keep:])
        del self.block_ids[keep:]

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one."""
        other = BlockTable(self.allocator, self.block_size)
        self.allocator.share(self.block_ids)
        other.block_ids = list(self.block_ids)
        return other

    def release(self) -> None:
        self.truncate(0)
