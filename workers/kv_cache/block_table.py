"""One sequence's view of the paged cache: which blocks hold its tokens, in order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from workers.kv_cache.block_allocator import BlockAllocator, NoFreeBlocksError, block_hashes

_VERSIONS = itertools.count(1)  # 0 stands for "unknown" (workers/engine/model_runner.py)


class BlockTable:
    """The blocks of one sequence. Token `i` lives in slot `block_ids[i // bs] * bs + i % bs`.

    Blocks may be shared with other sequences (refcount > 1); before new tokens are written into
    a shared block, `prepare_write` swaps it for a private copy (copy-on-write) and reports the
    copy the cache must make.

    `salt` roots the chain of block hashes (a request's `cache_salt`): tables of different
    salts never share cached blocks, so one tenant's prompts cannot be probed through another's
    cache hits.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, salt: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.salt = salt
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # of the leading full blocks registered for reuse
        self.version = next(_VERSIONS)

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
        bs, blocks, allocator = self.block_size, self.block_ids, self.allocator
        first, last = start // bs, (end - 1) // bs
        if first == last < len(blocks) and allocator.refcount(blocks[first]) == 1:
            return []  # a decode step inside its own block: nothing to allocate or copy
        touched = range(first, min(last + 1, len(blocks)))
        shared = [i for i in touched if allocator.refcount(blocks[i]) > 1]
        new = self.num_blocks_needed(end)
        if new + len(shared) > allocator.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {new + len(shared)} KV blocks, {allocator.num_free_blocks} free"
            )
        blocks += allocator.allocate(new)
        copies: list[tuple[int, int]] = []
        for index in shared:
            block = blocks[index]
            (private,) = allocator.allocate(1)
            allocator.free([block])
            blocks[index] = private
            copies.append((block, private))
        if new or shared:
            self.version = next(_VERSIONS)
        return copies

    def use_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Adopt the cached blocks of the longest cached prefix of `token_ids` (an empty
        table only); returns how many tokens they hold."""
        if self.block_ids:
            raise ValueError("a cached prefix can only start an empty block table")
        hashes = block_hashes(token_ids, self.block_size, self.salt)
        self.block_ids = self.allocator.lookup(hashes)
        self.block_hashes = hashes[: len(self.block_ids)]
        self.version = next(_VERSIONS)
        return len(self.block_ids) * self.block_size

    def cache_full_blocks(self, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register every block whose tokens are all committed and computed, for reuse."""
        bs = self.block_size
        done, full = len(self.block_hashes), num_computed_tokens // bs
        if full <= done:
            return
        parent = self.block_hashes[-1] if self.block_hashes else self.salt
        new = block_hashes(token_ids[done * bs : full * bs], bs, parent)
        for index, block_hash in enumerate(new, start=done):
            self.allocator.register(self.block_ids[index], block_hash)
        self.block_hashes += new

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of tokens `start..end-1`."""
        bs = self.block_size
        return [self.block_ids[i // bs] * bs + i % bs for i in range(start, end)]

    def truncate(self, num_tokens: int) -> None:
        """Keep the blocks that hold the first `num_tokens` tokens; free the rest (rollback)."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(self.block_ids):
            self.allocator.free(self.block_ids[keep:])
            del self.block_ids[keep:]
            self.version = next(_VERSIONS)
        full = num_tokens // self.block_size
        if full < len(self.block_hashes):
            del self.block_hashes[full:]

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one."""
        other = BlockTable(self.allocator, self.block_size, self.salt)
        self.allocator.share(self.block_ids)
        other.block_ids = list(self.block_ids)
        other.block_hashes = list(self.block_hashes)
        other.version = next(_VERSIONS)
        return other

    def release(self) -> None:
        self.truncate(0)
