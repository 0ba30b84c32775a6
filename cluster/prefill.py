"""The prefill pool: workers that compute a prompt's K/V (and hidden states) for a verifier.

A verifier sends the prompt minus its last token; the worker runs it through the target in
chunks over its own scratch paged cache, then sends over the pair's `TensorLink` the K/V of every
position (`[num_layers, 2, n, kv_heads, head_dim]`) and, when the request's drafter reads target
features, those layers' hidden states. The verifier writes the K/V straight into the request's
cache blocks (`LLMEngine.add_request(prefilled=...)`) and computes only the last prompt token
itself, which yields the first output token as usual. Nothing goes through the object store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.links import LinkAddress, TensorLink
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM

PREFILL_CHUNK = 512  # tokens per forward
LINK_TIMEOUT_S = 120.0  # a receive waits for the whole prefill


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What the verifier will receive, in order, for one prompt (plain data)."""

    num_tokens: int
    kv_shape: tuple[int, ...]
    hidden_layers: tuple[int, ...]
    hidden_size: int
    dtype: str


def plan_for(model_config: Any, num_tokens: int, layers: Sequence[int], dtype: str) -> PrefillPlan:
    kv_shape = (
        model_config.num_layers,
        2,
        num_tokens,
        model_config.num_kv_heads,
        model_config.head_dim,
    )
    return PrefillPlan(num_tokens, kv_shape, tuple(layers), model_config.hidden_size, dtype)


def receive(link: TensorLink, plan: PrefillPlan) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The verifier's side: the K/V, then the hidden states of each layer of the plan."""
    dtype = getattr(torch, plan.dtype)
    kv = link.recv(plan.kv_shape, dtype)
    hidden = {
        layer: link.recv((plan.num_tokens, plan.hidden_size), dtype) for layer in plan.hidden_layers
    }
    return kv, hidden


class PrefillWorker:
    """A target model and a scratch cache big enough for the longest prompt."""

    def __init__(self, model: TransformerLM, max_model_len: int, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = -(-max_model_len // block_size)
        cache = PagedKVCache(model.config, self.num_blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        self.link: TensorLink | None = None

    def open_link(self, address: LinkAddress) -> None:
        self.link = TensorLink.join(address, timeout_s=LINK_TIMEOUT_S)

    @torch.inference_mode()
    def compute(
        self, token_ids: Sequence[int], hidden_layers: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        n = len(token_ids)
        if not 0 < n <= self.num_blocks * self.block_size:
            raise ValueError(f"cannot prefill {n} tokens here")
        blocks = list(range(-(-n // self.block_size)))
        hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
        for start in range(0, n, PREFILL_CHUNK):
            chunk = list(token_ids[start : start + PREFILL_CHUNK])
            out = self.runner.forward(
                [SeqForward(chunk, start, blocks, num_logits=0)], hidden_layers=hidden_layers
            )
            for layer in hidden_layers:
                hidden[layer].append(out.output.hidden_states[layer])
        slots = torch.arange(n, device=self.model.device)  # blocks 0.. in order: slot = position
        kv = self.runner.kv_cache.read_slots(slots)
        return kv, {layer: torch.cat(rows) for layer, rows in hidden.items()}

    def prefill(self, token_ids: Sequence[int], hidden_layers: Sequence[int]) -> dict[str, Any]:
        """Compute and send over the link (the verifier is receiving); returns timings."""
        if self.link is None:
            raise RuntimeError("no link to a verifier")
        start = time.perf_counter()
        kv, hidden = self.compute(token_ids, hidden_layers)
        computed = time.perf_counter()
        self.link.send(kv)
        moved = kv.numel() * kv.element_size()
        for layer in hidden_layers:
            self.link.send(hidden[layer])
            moved += hidden[layer].numel() * hidden[layer].element_size()
        return {
            "compute_s": computed - start,
            "transfer_s": time.perf_counter() - computed,
            "bytes": moved,
        }
