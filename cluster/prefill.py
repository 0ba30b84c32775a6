"""The prefill pool: workers that compute a prompt's K/V (and hidden states) for a verifier.

A verifier sends the prompt; the worker runs it through the target in chunks over its own
scratch paged cache and sends over the pair's `TensorLink`, in this order: each layer's K and V
of every position (`[n, kv_heads, head_dim]` each, straight from the scratch cache, no copy)
as soon as the last chunk has gone through that layer, so the transfer overlaps the rest of the
forward; when the request's drafter reads target features, those layers' hidden states; the
last position's logits (`[vocab]`, fp32). The verifier receives the K/V into one
`[num_layers, 2, n, kv_heads, head_dim]` buffer, writes it straight into the request's cache
blocks (`LLMEngine.add_request(prefilled=...)`) and samples the first output token from the
logits with the request's own sampling settings and generator, so the first token costs it no
forward. Nothing goes through the object store.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.links import LinkAddress, LinkError, TensorLink
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


def distinct(layers: Sequence[int]) -> tuple[int, ...]:
    """Each layer once, in order (an EAGLE head of a shallow target may fuse a layer twice)."""
    return tuple(dict.fromkeys(layers))


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
        distinct(layers),
        model_config.hidden_size,
        model_config.vocab_size,
        dtype,
    )


def prompt_tag(token_ids: Sequence[int]) -> list[int]:
    """What a worker sends first for a prompt: its length and a checksum of its tokens, for the
    verifier to check it receives the prompt it asked for before anything of its size."""
    data = torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()
    return [len(token_ids), zlib.crc32(data)]


def receive(link: TensorLink, plan: PrefillPlan, token_ids: Sequence[int]) -> PrefillResult:
    """The verifier's side: the prompt's tag, then each layer's K and V, the hidden states of
    each layer of the plan, the logits. A tag not this prompt's raises `LinkError` before
    anything else is received: the link carries another prompt (and is not to be used again)."""
    tag = link.recv((2,), torch.int64).tolist()
    if tag != prompt_tag(token_ids):
        raise LinkError(f"the link carried another prompt ({tag} for {prompt_tag(token_ids)})")
    dtype = getattr(torch, plan.dtype)
    kv = torch.empty(plan.kv_shape, dtype=dtype, device=link.device)
    for layer in range(plan.kv_shape[0]):
        link.recv_into(kv[layer, 0])
        link.recv_into(kv[layer, 1])
    hidden = {
        layer: link.recv((plan.num_tokens, plan.hidden_size), dtype) for layer in plan.hidden_layers
    }
    return PrefillResult(kv, hidden, link.recv((plan.vocab_size,), torch.float32))


class PrefillWorker:
    """A target model and a scratch cache big enough for the longest prompt.

    The scratch cache still holds the last prompt's K/V (and the worker its hidden states), so
    a prompt that starts with the same tokens (a shared system prompt, the next turn of a chat)
    computes only what follows them; everything is sent all the same (the verifier's fresh
    blocks need the whole prompt)."""

    def __init__(self, model: TransformerLM, max_model_len: int, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = -(-max_model_len // block_size)
        cache = PagedKVCache(model.config, self.num_blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        # A link to each verifier group (by its rank 0's name): a worker serves several, and a
        # verifier that restarted opens its link again.
        self.links: dict[str, TensorLink] = {}
        self._held: list[int] = []  # the prompt whose K/V the scratch blocks hold
        self._held_hidden: dict[int, torch.Tensor] = {}  # and its hidden states, by layer
        self.reused_tokens = 0  # of the last prompt, taken from the one before

    def open_link(self, address: LinkAddress, verifier: str) -> None:
        """Join the link `verifier` hosts at `address` (in place of the one it had)."""
        self.links[verifier] = TensorLink.join(address, timeout_s=LINK_TIMEOUT_S)

    @torch.inference_mode()
    def compute(self, token_ids: Sequence[int], hidden_layers: Sequence[int]) -> PrefillResult:
        """The prompt's K/V (a copy), hidden states and last logits, in this process."""
        hidden, logits = self._forward(token_ids, distinct(hidden_layers))
        kv = self.runner.kv_cache.read_slots(torch.arange(len(token_ids), device=self.model.device))
        return PrefillResult(kv, hidden, logits)

    def prefill(
        self, token_ids: Sequence[int], hidden_layers: Sequence[int], verifier: str
    ) -> dict[str, Any]:
        """Compute and send over `verifier`'s link (it is receiving); returns timings:
        `compute_s` until the forward ends (the K/V of all but the last layers already sent
        meanwhile), `transfer_s` from there until the last tensor has arrived."""
        link = self.links.get(verifier)
        if link is None:
            raise RuntimeError(f"no link to {verifier}")
        tag = torch.tensor(prompt_tag(token_ids), dtype=torch.int64, device=self.model.device)
        link.send(tag, wait=False)
        hidden_layers = distinct(hidden_layers)
        n = len(token_ids)
        cache = self.runner.kv_cache
        moved = 0

        def send_layer(layer: int) -> None:
            nonlocal moved
            for tensor in cache.first_slots(layer, n):
                link.send(tensor, wait=False)  # left in flight: the forward goes on
                moved += tensor.numel() * tensor.element_size()

        start = time.perf_counter()
        try:
            hidden, logits = self._forward(token_ids, hidden_layers, send_layer)
            computed = time.perf_counter()
            for tensor in [*(hidden[layer] for layer in hidden_layers), logits]:
                link.send(tensor, wait=False)
                moved += tensor.numel() * tensor.element_size()
        finally:
            link.flush()  # the scratch cache is not rewritten while a send still reads it
        return {
            "compute_s": computed - start,
            "transfer_s": time.perf_counter() - computed,
            "bytes": moved,
            "reused_tokens": self.reused_tokens,
        }

    def _reusable(self, token_ids: Sequence[int], hidden_layers: Sequence[int]) -> int:
        """Leading tokens shared with the held prompt (all but the last token at most: its
        logits are wanted), when the held hidden states cover the layers asked for."""
        if not set(hidden_layers) <= self._held_hidden.keys():
            return 0
        limit = min(len(token_ids) - 1, len(self._held))
        shared = 0
        while shared < limit and token_ids[shared] == self._held[shared]:
            shared += 1
        return shared

    @torch.inference_mode()
    def _forward(
        self,
        token_ids: Sequence[int],
        hidden_layers: Sequence[int],
        layer_done: Callable[[int], None] | None = None,
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Run the prompt into scratch blocks 0, 1, ... (slot = position), from the first token
        the held prompt does not share; `layer_done(i)` is called once layer i has written the
        K/V of the last chunk, so of the whole prompt."""
        n = len(token_ids)
        if not 0 < n <= self.num_blocks * self.block_size:
            raise ValueError(f"cannot prefill {n} tokens here")
        reused = self._reusable(token_ids, hidden_layers)
        hidden = {
            layer: [self._held_hidden[layer][:reused]] if reused else [] for layer in hidden_layers
        }
        self._held, self._held_hidden = [], {}  # the scratch is being rewritten
        self.reused_tokens = reused
        blocks = list(range(-(-n // self.block_size)))
        hooks = []
        for start in range(reused, n, PREFILL_CHUNK):
            chunk = list(token_ids[start : start + PREFILL_CHUNK])
            last = start + len(chunk) == n
            if last and layer_done is not None:
                hooks = [
                    layer.register_forward_hook(lambda *_, i=i: layer_done(i))
                    for i, layer in enumerate(self.model.layers)
                ]
            try:
                out = self.runner.forward(
                    [SeqForward(chunk, start, blocks, num_logits=int(last))],
                    hidden_layers=hidden_layers,
                )
            finally:
                for hook in hooks:
                    hook.remove()
            for layer in hidden_layers:
                hidden[layer].append(out.output.hidden_states[layer])
        logits = out.logits_of(0)[-1].float()
        whole = {layer: torch.cat(rows) for layer, rows in hidden.items()}
        self._held, self._held_hidden = list(token_ids), whole
        return whole, logits
