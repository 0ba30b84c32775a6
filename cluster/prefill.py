"""The prefill pool: workers that compute a prompt's K/V (and hidden states) for a verifier.

A verifier sends the prompt; the worker runs it through the target in chunks over its own
scratch paged cache, then sends over the pair's `TensorLink` the K/V of every position
(`[num_layers, 2, n, kv_heads, head_dim]`), when the request's drafter reads target features
those layers' hidden states, and the last position's logits (`[vocab]`, fp32). The verifier
writes the K/V straight into the request's cache blocks (`LLMEngine.add_request(prefilled=...)`)
and samples the first output token from the logits with the request's own sampling settings and
generator, so the first token costs it no forward. Nothing goes through the object store.
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
    vocab_size: int
    dtype: str


@dataclass(frozen=True, slots=True)
class PrefillResult:
    kv: torch.Tensor  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
    hidden: dict[int, torch.Tensor]  # layer -> [num_tokens, hidden_size]
    logits: torch.Tensor  # [vocab] fp32, of the last position


def plan_for(model_config: Any, num_tokens: int, layers: Sequence[int], dtype: str) -> PrefillPlan:
    kv_shape = (
        model_config.num_layers,
        2,
        num_tokens,
        model_config.num_kv_heads,
        model_config.head_dim,
    )
    return PrefillPlan(
        num_tokens,
        kv_shape,
        tuple(layers),
        model_config.hidden_size,
        model_config.vocab_size,
        dtype,
    )


def receive(link: TensorLink, plan: PrefillPlan) -> PrefillResult:
    """The verifier's side: the K/V, the hidden states of each layer of the plan, the logits."""
    dtype = getattr(torch, plan.dtype)
    kv = link.recv(plan.kv_shape, dtype)
    hidden = {
        layer: link.recv((plan.num_tokens, plan.hidden_size), dtype) for layer in plan.hidden_layers
    }
    return PrefillResult(kv, hidden, link.recv((plan.vocab_size,), torch.float32))


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
    def compute(self, token_ids: Sequence[int], hidden_layers: Sequence[int]) -> PrefillResult:
        n = len(token_ids)
        if not 0 < n <= self.num_blocks * self.block_size:
            raise ValueError(f"cannot prefill {n} tokens here")
        blocks = list(range(-(-n // self.block_size)))
        hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in hidden_layers}
        for start in range(0, n, PREFILL_CHUNK):
            chunk = list(token_ids[start : start + PREFILL_CHUNK])
            last = start + len(chunk) == n
            out = self.runner.forward(
                [SeqForward(chunk, start, blocks, num_logits=int(last))],
                hidden_layers=hidden_layers,
            )
            for layer in hidden_layers:
                hidden[layer].append(out.output.hidden_states[layer])
        logits = out.logits_of(0)[-1].float()
        slots = torch.arange(n, device=self.model.device)  # blocks 0.. in order: slot = position
        kv = self.runner.kv_cache.read_slots(slots)
        return PrefillResult(kv, {layer: torch.cat(rows) for layer, rows in hidden.items()}, logits)

    def prefill(self, token_ids: Sequence[int], hidden_layers: Sequence[int]) -> dict[str, Any]:
        """Compute and send over the link (the verifier is receiving); returns timings."""
        if self.link is None:
            raise RuntimeError("no link to a verifier")
        start = time.perf_counter()
        result = self.compute(token_ids, hidden_layers)
        computed = time.perf_counter()
        tensors = [result.kv, *(result.hidden[layer] for layer in hidden_layers), result.logits]
        for tensor in tensors:
            self.link.send(tensor.contiguous())
        moved = sum(t.numel() * t.element_size() for t in tensors)
        return {
            "compute_s": computed - start,
            "transfer_s": time.perf_counter() - computed,
            "bytes": moved,
        }
