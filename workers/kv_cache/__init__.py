"""The paged KV cache: block allocator (refcounted), per-sequence block tables, cache tensors."""

from workers.kv_cache.block_allocator import BlockAllocator, NoFreeBlocksError, block_hashes
from workers.kv_cache.block_table import BlockTable
from workers.kv_cache.paged_cache import PagedKVCache

__all__ = ["BlockAllocator", "BlockTable", "NoFreeBlocksError", "PagedKVCache", "block_hashes"]
