"""flash-attn's paged varlen kernel as an attention backend, and the choice of a model's
backend for its device (`select_attention_backend`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    NativeCpuAttention,
    SdpaAttention,
)


@dataclass(frozen=True, slots=True)
class _FlashPlan:
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    max_query_len: int
    max_seq_len: int


def _load_flash_module() -> ModuleType | None:
    for name in ("vllm_flash_attn", "flash_attn"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "flash_attn_varlen_func"):
            return module
    return None


def _flash_block_multiple(module: ModuleType) -> int:
    """Upstream flash-attn reads a paged cache only in blocks of 256k; vLLM's fork in 16k."""
    return 16 if module.__name__ == "vllm_flash_attn" else 256


class FlashAttention(AttentionBackend):
    """Paged attention with flash-attn's varlen kernel reading the cache through block tables.

    CUDA only, fp16/bf16 only. Uses `vllm_flash_attn` when installed (vLLM images), else
    upstream `flash_attn` (the `gpu` extra); both expose the same `flash_attn_varlen_func`.
    flash-attn masks causally only: a forward holding a draft tree's rows goes to SDPA whole
    (an eager tree step: the graphs take most of them as tail masks).
    """

    name = "flash"
    serves_trees = True

    def __init__(self) -> None:
        module = _load_flash_module()
        if module is None:
            raise RuntimeError("flash attention needs `vllm_flash_attn` or `flash_attn` installed")
        self._varlen = module.flash_attn_varlen_func
        self.block_multiple = _flash_block_multiple(module)
        self._trees = SdpaAttention()

    def prepare(self, meta: AttentionMetadata) -> Any:
        """A `_FlashPlan`, or (a forward with a draft tree) SDPA's plan."""
        if meta.tree is not None:
            return self._trees.prepare(meta)
        if meta.block_size % self.block_multiple:
            raise ValueError(
                f"this flash-attn build needs a KV block size divisible by {self.block_multiple}, "
                f"got {meta.block_size}"
            )
        cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        return _FlashPlan(
            cu_seqlens_q=meta.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_k,
            block_tables=meta.block_tables.to(torch.int32),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        if not isinstance(plan, _FlashPlan):  # a draft tree's forward
            return self._trees.forward(query, key_cache, value_cache, plan, scale)
        # flash-attn aligns the causal mask to the bottom right when a query is shorter than its
        # keys, which is exactly "each new token sees the context up to its own position".
        out: torch.Tensor = self._varlen(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_query_len,
            max_seqlen_k=plan.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=plan.block_tables,
        )
        return out


def flash_attention_available(
    device: torch.device, dtype: torch.dtype, block_size: int = 16
) -> bool:
    """Whether the flash backend can serve this device, dtype and KV block size."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    module = _load_flash_module()
    return module is not None and block_size % _flash_block_multiple(module) == 0


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, block_size: int = 16, prefer: str | None = None
) -> AttentionBackend:
    """`prefer` is "sdpa" (torch's SDPA only), "flash" or None (flash where it can run, else
    SDPA, with our CPU kernel for decode and verification on a CPU: `NativeCpuAttention`)."""
    if prefer not in (None, "sdpa", "flash"):
        raise ValueError(f"unknown attention backend {prefer!r}; choose 'sdpa' or 'flash'")
    if prefer == "sdpa":
        return SdpaAttention()
    if flash_attention_available(device, dtype, block_size):
        return FlashAttention()
    if prefer == "flash":
        raise RuntimeError(
            f"flash attention is not available for {device.type}/{dtype} with KV blocks of "
            f"{block_size} (it needs CUDA, fp16/bf16, and vllm_flash_attn, or flash_attn with "
            "blocks of 256k)"
        )
    return NativeCpuAttention() if device.type == "cpu" else SdpaAttention()
