"""Our forward pass of a llama-family model over a flattened batch and a paged KV cache.

Every sequence in a batch brings any number of new tokens at its own positions (a prefill chunk,
one decode token, or the last token plus k draft tokens); their keys and values go into the
cache slots the caller chose, and attention reads each sequence's context through its block table
(kernels/attention.py). Q/K/V and gate/up projections are fused into one matmul each.

A projection's weight (and the token embedding) may be kept in quantized blocks
(kernels/quant.py): `load_hf_weights` then puts a `QuantizedLinear` (or `QuantizedEmbedding`)
where the float module was, and the forward is the same code (kernels/linear.py dispatches on
the weight). Those weights stay on the CPU and in their blocks whatever `.to()` is asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import quant
from kernels.activation import silu_and_mul
from kernels.attention import AttentionBackend, AttentionMetadata, NativeCpuAttention
from kernels.attention_invariant import InvariantAttention
from kernels.linear import WeightPacks
from kernels.norm import rms_norm
from kernels.quant import QuantizedWeight, Weight, cat_rows, weight_nbytes
from kernels.rotary import RotaryAngles, rope_cos_sin, rotate_and_store
from workers.model.config import ModelConfig
from workers.model.native_layers import NativeLayers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor  # [num_logits, vocab] fp32, rows in the order of logits_indices
    hidden_states: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # layer -> [num_tokens, hidden]
    final_hidden: torch.Tensor | None = None  # [num_tokens, hidden], after the final norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), or (norm(x), x) without a residual: one kernel
        call in bf16 on the CPU and on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual)


class QuantizedLinear(nn.Module):
    """A projection whose weight stays in quantized blocks: `weight` is a `QuantizedWeight`
    (not a parameter, so `.to(dtype)` leaves it alone); the bias, if any, is a parameter."""

    def __init__(self, weight: QuantizedWeight, bias: bool) -> None:
        super().__init__()
        self.weight = weight
        # Loaded with the float weights (`load_state_dict`); cast with the model.
        empty = torch.empty(weight.shape[0], device="meta")
        self.bias = nn.Parameter(empty, requires_grad=False) if bias else None


class QuantizedEmbedding(nn.Module):
    """A token embedding kept in quantized blocks: a lookup dequantizes the rows it reads, and a
    tied LM head projects with the blocks."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden] fp32
        return self.weight.rows(ids, torch.float32).to(ids.device)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3: each query and key head RMS-normalized (one weight a head_dim) before rotary.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.packs = WeightPacks()
        # Set where this process computes as a tensor-parallel group would (tensor_parallel.py
        # `emulate_row_parallel`): each rank's input columns and its slice of o_proj.
        self.row_parts: list[tuple[range, Weight]] = []

    def attend(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 kv_size]: the QKV projection
        angles: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = qkv.shape[0]
        key_cache, value_cache = kv_cache
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, 0, self.q_size, self.q_norm)
            self._norm_heads(qkv, self.q_size, self.kv_size, self.k_norm)
        q = rotate_and_store(qkv, self.num_heads, angles, key_cache, value_cache, meta.slot_mapping)
        out = backend.forward(q, key_cache, value_cache, plan, self.scale)
        out = out.reshape(num_tokens, self.q_size)
        if not self.row_parts:
            return self.packs.linear("o", out, self.o_proj.weight)
        return _group_sum(
            self.packs.linear(f"o{r}", out[:, cols.start : cols.stop].contiguous(), weight)
            for r, (cols, weight) in enumerate(self.row_parts)
        )

    def _norm_heads(self, qkv: torch.Tensor, start: int, size: int, norm: RMSNorm) -> None:
        """Normalize the heads in columns [start, start + size) of `qkv`, in place."""
        part = qkv[:, start : start + size]
        heads = norm(part.reshape(-1, self.head_dim))  # [num_tokens * heads, head_dim]
        part.copy_(heads.view(part.shape))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.packs = WeightPacks()
        # As Attention's: each rank's intermediate units and its slice of down_proj.
        self.row_parts: list[tuple[range, Weight]] = []

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 inter] -> hidden
        if not self.row_parts:
            return self._down("down", gate_up, self.down_proj.weight)
        inter = self.intermediate_size
        return _group_sum(
            self._down(
                f"down{r}",
                torch.cat(
                    (
                        gate_up[:, units.start : units.stop],
                        gate_up[:, inter + units.start : inter + units.stop],
                    ),
                    dim=1,
                ),
                weight,
            )
            for r, (units, weight) in enumerate(self.row_parts)
        )

    def _down(self, name: str, gate_up: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return quant.silu_linear(gate_up, weight)
        return self.packs.linear(name, silu_and_mul(gate_up), weight)


def _group_sum(partials: Iterable[torch.Tensor]) -> torch.Tensor:
    """The ranks' partial sums added in rank order in their own dtype, as the group's all-reduce
    adds them (for two ranks the order does not matter: a + b rounds once either way)."""
    total: torch.Tensor | None = None
    for partial in partials:
        total = partial if total is None else total + partial
    assert total is not None
    return total


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        angles: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        plan: object,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `h + residual` (`h` alone for the first layer): the layer
        before left its MLP output unadded, so that the add and this layer's norm are one
        kernel. Returns this layer's MLP output and the stream before it, likewise."""
        attn_in, residual = self._project_norm(
            self.input_layernorm, h, residual, self.self_attn.qkv_proj, self.self_attn.packs, "qkv"
        )
        attn = self.self_attn.attend(attn_in, angles, kv_cache, meta, backend, plan)
        gate_up, residual = self._project_norm(
            self.post_attention_layernorm,
            attn if reduce is None else reduce(attn),
            residual,
            self.mlp.gate_up_proj,
            self.mlp.packs,
            "gate_up",
        )
        mlp = self.mlp.down(gate_up)
        return (mlp if reduce is None else reduce(mlp)), residual

    @staticmethod
    def _project_norm(
        norm: RMSNorm,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        proj: nn.Linear | QuantizedLinear,
        packs: WeightPacks,
        name: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(norm(h + residual)), h + residual): one kernel call where the projection's
        weight is quantized (kernels/quant.py `norm_linear`), as nothing else reads the norm."""
        weight, bias = proj.weight, proj.bias
        if isinstance(weight, QuantizedWeight):
            return quant.norm_linear(h, residual, norm.weight, norm.eps, weight, bias)
        normed, residual = norm.add_forward(h, residual)
        return packs.linear(name, normed, weight, bias), residual


class ForwardInterrupted(Exception):
    """A forward given up between two layers (`interrupt`); the K/V it wrote is garbage past
    the sequences' cached lengths, which their owner rolls back to."""


class TransformerLM(nn.Module):
    """Llama-family decoder (workers/model/config.py ARCHITECTURES) over a paged KV cache; see
    the module docstring."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention or NativeCpuAttention()
        with torch.device("meta"):  # weights arrive in load_hf_weights; skip random init
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        # Tensor parallelism: this rank holds a slice of the heads and of the MLP, and `reduce`
        # sums the partial attention and MLP outputs over the group (workers/model/
        # tensor_parallel.py). None: the whole model is here.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.packs = WeightPacks()  # the LM head's (the layers keep their own)
        # The layers as one native call each takes them (workers/model/native_layers.py):
        # made at the first forward, forgotten when the weights or their kernels change.
        self._native_layers: NativeLayers | None = None
        self._native_checked = False
        # Rotary tables stay fp32 whatever the model dtype (so not buffers: .to(dtype) would cast).
        self._cos, self._sin = rope_cos_sin(
            config.head_dim, config.max_context, config.rope_theta, scaling=config.rope_scaling
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def layers_changed(self) -> None:
        """Forget what was made of the layers' weights (their native form): to be called by
        whatever replaces a layer's weights or changes how a layer computes."""
        self._native_layers, self._native_checked = None, False

    def _apply(self, fn: Callable[..., object], recurse: bool = True) -> TransformerLM:
        self.layers_changed()  # `.to()` and the like move or cast the weights
        return super()._apply(fn, recurse)

    def use_batch_invariant_kernels(self) -> None:
        """Project and attend through kernels whose every row is computed alike in any batch,
        step or prefill chunk (kernels/batch_invariant.py, attention_invariant.py): a token's
        logits then depend on its sequence alone. `--deterministic` on a GPU; norms, SwiGLU and
        rotary are row-wise already there."""
        for module in self.modules():
            packs = getattr(module, "packs", None)
            if isinstance(packs, WeightPacks):
                packs.batch_invariant = True
        self.attention = InvariantAttention()

    def load_hf_weights(self, weights: dict[str, Weight]) -> None:
        """Take weights under Hugging Face names, fusing q/k/v and gate/up. Quantized weights
        (`QuantizedWeight`) keep their blocks: their modules become `QuantizedLinear` or
        `QuantizedEmbedding`; a fused projection whose parts are not all quantized alike is
        dequantized."""
        self.layers_changed()
        expected = _hf_names(self.config)
        if self.config.tie_word_embeddings:  # some tied checkpoints still store a copy
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        missing = sorted(expected - weights.keys())
        unexpected = sorted(weights.keys() - expected)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        state: dict[str, Weight] = {
            "embed_tokens.weight": weights["model.embed_tokens.weight"],
            "norm.weight": weights["model.norm.weight"],
        }
        if self.lm_head is not None:
            state["lm_head.weight"] = weights["lm_head.weight"]
        for i in range(self.config.num_layers):
            hf, ours = f"model.layers.{i}.", f"layers.{i}."
            attn = hf + "self_attn."
            state[ours + "input_layernorm.weight"] = weights[hf + "input_layernorm.weight"]
            state[ours + "post_attention_layernorm.weight"] = weights[
                hf + "post_attention_layernorm.weight"
            ]
            for kind in ("weight", "bias") if self.config.attention_bias else ("weight",):
                state[ours + f"self_attn.qkv_proj.{kind}"] = _stack(
                    [weights[attn + f"{p}_proj.{kind}"] for p in "qkv"]
                )
            if self.config.qk_norm:
                for p in "qk":
                    state[ours + f"self_attn.{p}_norm.weight"] = weights[attn + f"{p}_norm.weight"]
            state[ours + "self_attn.o_proj.weight"] = weights[attn + "o_proj.weight"]
            state[ours + "mlp.gate_up_proj.weight"] = _stack(
                [weights[hf + "mlp.gate_proj.weight"], weights[hf + "mlp.up_proj.weight"]]
            )
            state[ours + "mlp.down_proj.weight"] = weights[hf + "mlp.down_proj.weight"]
        for name, weight in list(state.items()):
            if isinstance(weight, QuantizedWeight):
                self._keep_quantized(name.removesuffix(".weight"), weight, state)
        floats = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.load_state_dict(floats, strict=True, assign=True)

    def _keep_quantized(self, module_name: str, weight: QuantizedWeight, state: dict) -> None:
        """Put a quantized module in place of the float one `module_name` names (its bias, if
        any, stays in `state` for the new module's parameter)."""
        parent_name, _, attr = module_name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        module: nn.Module
        if attr == "embed_tokens":
            module = QuantizedEmbedding(weight)
        else:
            module = QuantizedLinear(weight, bias=f"{module_name}.bias" in state)
        setattr(parent, attr, module)
        del state[f"{module_name}.weight"]

    def lm_head_weight(self) -> Weight:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def quantized_kinds(self) -> dict[str, int]:
        """How many weights are kept in each quantized block type ({} for a float model)."""
        kinds: dict[str, int] = {}
        for module in self.modules():
            if isinstance(module, QuantizedLinear | QuantizedEmbedding):
                kinds[module.weight.kind] = kinds.get(module.weight.kind, 0) + 1
        return kinds

    def step_weight_bytes(self) -> int:
        """The weight bytes one decode step streams: every projection and the LM head (the
        embedding's lookup reads a few rows, the norms are small)."""
        weights: list[Weight] = [self.lm_head_weight()]
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            weights += [attn.qkv_proj.weight, attn.o_proj.weight]
            weights += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
        return sum(map(weight_nbytes, weights))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # one (key, value) per layer
        logits_indices: torch.Tensor,  # [num_logits] int64 rows of the batch to score
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
        interrupt: Callable[[], bool] | None = None,
        attention: AttentionBackend | None = None,
    ) -> ModelOutput:
        """`interrupt`, checked after each layer, gives the forward up (`ForwardInterrupted`)
        when it turns true: for work that has lost its purpose (drafting ahead on a guess that
        the verifier has just proved wrong). Never for a sharded model, whose ranks must run
        the same layers. `attention`: a backend for this forward instead of the model's (a
        uniform decode/verify batch: workers/engine/graph_runner.py)."""
        backend = attention or self.attention
        plan = backend.prepare(meta)
        angles = self._angles(positions)
        wanted = set(hidden_layers)
        hidden: dict[int, torch.Tensor] = {}
        h: torch.Tensor = self.embed_tokens(input_ids).to(self.dtype)

        def after_layer(i: int, h: torch.Tensor, residual: torch.Tensor) -> None:
            if i in wanted:
                hidden[i] = h + residual
            if interrupt is not None and interrupt():
                raise ForwardInterrupted(f"interrupted after layer {i}")

        residual: torch.Tensor | None = None
        native = self._native() if self.reduce is None else None
        done = native and native.run(h, angles, kv_caches, meta, backend, plan, after_layer)
        if done:
            h, residual = done
        else:
            for i, layer in enumerate(self.layers):
                h, residual = layer(
                    h, residual, angles, kv_caches[i], meta, backend, plan, self.reduce
                )
                after_layer(i, h, residual)
        h = self.norm.add_forward(h, residual)[0]
        rows = h.index_select(0, logits_indices)
        logits = self.packs.linear("lm_head", rows, self.lm_head_weight()).float()
        return ModelOutput(logits, hidden, h if return_final_hidden else None)

    def _native(self) -> NativeLayers | None:
        if not self._native_checked:
            self._native_layers, self._native_checked = NativeLayers.of(self), True
        return self._native_layers

    def _angles(self, positions: torch.Tensor) -> RotaryAngles:
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return RotaryAngles(self._cos, self._sin, positions, self.dtype)


def make_deterministic(model: TransformerLM, tree_nodes: int = 0) -> TransformerLM:
    """`--deterministic`: a GPU model's forwards through batch-invariant kernels
    (`TransformerLM.use_batch_invariant_kernels`), so that a token's logits depend on its
    sequence alone; a CPU model's kernels are so already. Draft trees are refused there: a
    node's attention sums its keys in other tiles than the same token's in a chain."""
    if model.device.type != "cuda":
        return model
    if tree_nodes:
        raise ValueError(
            "deterministic kernels on a GPU verify draft chains only: set speculative.tree_nodes "
            "to 0 (--draft-tree-nodes 0) or drop --deterministic"
        )
    model.use_batch_invariant_kernels()
    log.info("deterministic: batch-invariant projections and attention (%s)", model.attention.name)
    return model


def _stack(parts: list[Weight]) -> Weight:
    """Fused projections' weights (or biases) stacked along their outputs: in their blocks when
    all are quantized alike, else as floats."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
        if len({(p.kind, p.in_features) for p in quantized}) == 1:
            return cat_rows(quantized)
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])


def _hf_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if config.attention_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if config.qk_norm:
            names |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
    return names
