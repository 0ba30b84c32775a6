"""A decoder layer of the bundled model (its first, in bf16 over its Q4_1 blocks), as the model
runs it on our kernels (workers/model/transformer.py DecoderLayer): the RMSNorm fused into the
QKV projection, rotary and the cache write, paged attention, the output projection, the RMSNorm
with the residual fused into the gate/up projection, SwiGLU fused into the down projection.

`layer_script` writes those calls for tests/arm64/harness.c; `layer_on_this_host` makes the
same calls through kernels/native.py and kernels/quant.py, as the model does. Two steps: a
prefill of PROMPT's tokens, then one decode token over the cache the prefill wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native, quant
from kernels.quant import QuantizedWeight
from kernels.rotary import rope_cos_sin
from tests.arm64.cases import THREADS, quant_args
from tests.arm64.cross import Buffer, Script
from workers.model.loader import Checkpoint

PROMPT = [
    1,
    504,
    3458,
    314,
    260,
    1345,
    2377,
    28,
    1041,
    253,
    4798,
    30,
    2,
    198,
    520,
    9531,
    42,
    2,
    4111,
    101,
]
NEXT = 504
BLOCK_SIZE, BLOCK_TABLE, NUM_BLOCKS = 16, [3, 1], 4  # PROMPT and NEXT in two blocks, shuffled
MAX_POSITIONS = 64


@dataclass(frozen=True)
class Layer:
    num_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    eps: float
    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor
    qkv: QuantizedWeight
    o: QuantizedWeight
    gate_up: QuantizedWeight
    down: QuantizedWeight
    cos: torch.Tensor  # fp32 [MAX_POSITIONS, head_dim]
    sin: torch.Tensor
    inputs: tuple[torch.Tensor, torch.Tensor]  # bf16 embeddings of PROMPT and of NEXT

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.kv_heads) * self.head_dim


def first_layer(checkpoint: Checkpoint) -> Layer:
    """Layer 0's weights as the model keeps them (Q/K/V and gate/up fused) and its inputs: the
    embeddings of PROMPT and NEXT."""
    c, w = checkpoint.config, checkpoint.weights
    name = "model.layers.0."

    def blocks(*names: str) -> QuantizedWeight:
        parts = [w[name + n + ".weight"] for n in names]
        assert all(isinstance(p, QuantizedWeight) for p in parts), "load with quantization='gguf'"
        return quant.cat_rows(parts)  # type: ignore[arg-type]

    embed = w["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedWeight)
    cos, sin = rope_cos_sin(c.head_dim, MAX_POSITIONS, c.rope_theta)
    return Layer(
        num_heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden=c.hidden_size,
        inter=c.intermediate_size,
        eps=c.rms_norm_eps,
        input_norm=w[name + "input_layernorm.weight"].bfloat16(),  # type: ignore[union-attr]
        post_norm=w[name + "post_attention_layernorm.weight"].bfloat16(),  # type: ignore[union-attr]
        qkv=blocks("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        o=blocks("self_attn.o_proj"),
        gate_up=blocks("mlp.gate_proj", "mlp.up_proj"),
        down=blocks("mlp.down_proj"),
        cos=cos.float().contiguous(),
        sin=sin.float().contiguous(),
        inputs=tuple(
            embed.rows(torch.tensor(ids), torch.float32).bfloat16() for ids in (PROMPT, [NEXT])
        ),  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Step:
    """The prefill or the decode step: its tokens' positions, cache slots and inputs."""

    h: torch.Tensor  # bf16 [n, hidden]: the tokens' embeddings
    positions: torch.Tensor  # int64 [n]
    slots: torch.Tensor  # int64 [n]
    lens: list[torch.Tensor]  # int32 [1] each: the query start, query length, sequence length

    @property
    def n(self) -> int:
        return self.h.shape[0]


def _steps(layer: Layer) -> list[Step]:
    steps = []
    for first, h in zip((0, len(PROMPT)), layer.inputs, strict=True):
        n = h.shape[0]
        positions = torch.arange(first, first + n)
        slots = [BLOCK_TABLE[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        lens = [torch.tensor([v], dtype=torch.int32) for v in (0, n, first + n)]
        steps.append(Step(h, positions, torch.tensor(slots), lens))
    return steps


def layer_script(layer: Layer) -> tuple[Script, list[Buffer]]:
    """The layer's calls for the harness; the buffers to compare: each step's MLP output and
    residual stream, then the KV cache."""
    s = Script()
    shape = (NUM_BLOCKS, BLOCK_SIZE, layer.kv_heads, layer.head_dim)
    k_cache, v_cache = s.zeros(*shape, dtype=torch.bfloat16), s.zeros(*shape, dtype=torch.bfloat16)
    table = s.tensor(torch.tensor([BLOCK_TABLE], dtype=torch.int32))
    cos, sin = s.tensor(layer.cos), s.tensor(layer.sin)
    weights = {n: quant_args(s, getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down")}
    input_norm, post_norm = s.tensor(layer.input_norm), s.tensor(layer.post_norm)
    outputs: list[Buffer] = []
    hidden, q_size = layer.hidden, layer.num_heads * layer.head_dim
    for step in _steps(layer):
        n = step.n
        x = s.tensor(step.h)
        qkv = s.zeros(n, layer.qkv_width, dtype=torch.bfloat16)
        qkv_weight = weights["qkv"]
        s.call(
            "outrider_linear_quant_after",
            1,
            x,
            None,
            input_norm,
            layer.eps,
            None,
            *qkv_weight,
            None,
            qkv,
            n,
            hidden,
            layer.qkv_width,
            THREADS,
        )
        s.call(
            "outrider_rotary_kv_bf16",
            qkv,
            layer.qkv_width,
            n,
            layer.num_heads,
            layer.kv_heads,
            layer.head_dim,
            s.tensor(step.positions),
            cos,
            sin,
            MAX_POSITIONS,
            s.tensor(step.slots),
            NUM_BLOCKS * BLOCK_SIZE,
            k_cache,
            v_cache,
            THREADS,
        )
        attn = s.zeros(n, q_size, dtype=torch.bfloat16)
        s.call(
            "outrider_paged_attention_bf16",
            qkv,
            layer.qkv_width,
            k_cache,
            v_cache,
            table,
            len(BLOCK_TABLE),
            *(s.tensor(t) for t in step.lens),
            1,
            layer.num_heads,
            layer.kv_heads,
            layer.head_dim,
            BLOCK_SIZE,
            layer.head_dim**-0.5,
            attn,
            q_size,
            THREADS,
        )
        o = s.zeros(n, hidden, dtype=torch.bfloat16)
        s.call("outrider_linear_quant", attn, 0, *weights["o"], None, o, n, q_size, hidden, THREADS)
        gate_up = s.zeros(n, 2 * layer.inter, dtype=torch.bfloat16)
        stream = s.zeros(n, hidden, dtype=torch.bfloat16)
        s.call(
            "outrider_linear_quant_after",
            1,
            o,
            x,
            post_norm,
            layer.eps,
            stream,
            *weights["gate_up"],
            None,
            gate_up,
            n,
            hidden,
            2 * layer.inter,
            THREADS,
        )
        mlp = s.zeros(n, hidden, dtype=torch.bfloat16)
        s.call(
            "outrider_linear_quant_after",
            2,
            gate_up,
            None,
            None,
            0.0,
            None,
            *weights["down"],
            None,
            mlp,
            n,
            layer.inter,
            hidden,
            THREADS,
        )
        outputs += [mlp, stream]
    return s, [*outputs, k_cache, v_cache]


def layer_on_this_host(layer: Layer) -> list[torch.Tensor]:
    """The same calls through the kernels' Python entry points (what the model calls), in this
    process: the tensors `layer_script`'s buffers hold after the harness runs it."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, layer.kv_heads, layer.head_dim)
    k_cache, v_cache = (
        torch.zeros(shape, dtype=torch.bfloat16),
        torch.zeros(shape, dtype=torch.bfloat16),
    )
    table = torch.tensor([BLOCK_TABLE], dtype=torch.int32)
    q_size, out = layer.num_heads * layer.head_dim, []
    for step in _steps(layer):
        n, h = step.n, step.h
        qkv, _ = quant.norm_linear(h, None, layer.input_norm, layer.eps, layer.qkv)
        native.rotary_kv_bf16(
            qkv, layer.num_heads, step.positions, layer.cos, layer.sin, step.slots, k_cache, v_cache
        )
        q = qkv[:, :q_size].view(n, layer.num_heads, layer.head_dim)
        attn = torch.empty(n, layer.num_heads, layer.head_dim, dtype=torch.bfloat16)
        native.paged_attention(q, k_cache, v_cache, table, *step.lens, layer.head_dim**-0.5, attn)
        o = quant.linear(attn.view(n, q_size), layer.o)
        gate_up, stream = quant.norm_linear(o, h, layer.post_norm, layer.eps, layer.gate_up)
        out += [quant.silu_linear(gate_up, layer.down), stream]
    return [*out, k_cache, v_cache]
