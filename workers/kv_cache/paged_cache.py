"""The KV cache tensors: per layer, keys and values in fixed-size blocks."""

from __future__ import annotations

import torch

from kernels.host_copy import queued_tensor
from workers.model.config import ModelConfig


class PagedKVCache:
    """`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, one allocation."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            config.num_layers,
            2,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.kv_size * itemsize

    @classmethod
    def for_memory(
        cls,
        config: ModelConfig,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> PagedKVCache:
        """As many blocks as fit in `memory_bytes`."""
        num_blocks = memory_bytes // cls.bytes_per_block(config, block_size, dtype)
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes} bytes hold no KV block of size {block_size}")
        return cls(config, int(num_blocks), block_size, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer; used for copy-on-write."""
        if not copies:
            return
        # Queued, not waited for: an async engine makes these while its last step runs.
        src = queued_tensor([s for s, _ in copies], torch.int64, self.data.device)
        dst = queued_tensor([d for _, d in copies], torch.int64, self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]

    def write_slots(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Put K/V for n tokens (`[num_layers, 2, n, kv_heads, head_dim]`) into cache slots `slots`
        (`[n]`, block * block_size + offset): how a remote prefill lands in this cache (from
        wherever its link delivered it)."""
        layers, _, num_blocks, block_size, heads, dim = self.data.shape
        if kv.shape != (layers, 2, slots.shape[0], heads, dim):
            raise ValueError(f"K/V of shape {tuple(kv.shape)} does not fit this cache")
        flat = self.data.view(layers, 2, num_blocks * block_size, heads, dim)
        flat[:, :, slots] = kv.to(device=self.data.device, dtype=self.data.dtype)

    def first_slots(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of slots 0..n-1 of one layer, `[n, kv_heads, head_dim]` each: views, not
        copies (contiguous), of a sequence written into blocks 0, 1, 2, ... in order."""
        _, _, num_blocks, block_size, heads, dim = self.data.shape
        if not 0 < n <= num_blocks * block_size:
            raise ValueError(f"the cache holds {num_blocks * block_size} slots, not {n}")
        k, v = (
            self.data[layer, kind].view(num_blocks * block_size, heads, dim)[:n] for kind in (0, 1)
        )
        return k, v

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """K/V of the tokens in `slots`, `[num_layers, 2, n, kv_heads, head_dim]` (contiguous)."""
        layers, _, num_blocks, block_size, heads, dim = self.data.shape
        flat = self.data.view(layers, 2, num_blocks * block_size, heads, dim)
        return flat[:, :, slots].contiguous()
