"""Tensor parallelism: one rank's slice of a llama-family model.

Attention is split by KV heads (each rank keeps whole query groups, so GQA stays local) and the
MLP by intermediate columns, Megatron style: q/k/v and gate/up projections are column-parallel
(each rank computes its heads / its slice of the hidden MLP units), o_proj and down_proj are
row-parallel (each rank produces a partial sum of the full hidden vector), and an all-reduce
after each of the two sums them, so every rank holds the full residual stream. Embeddings,
norms and the LM head are replicated. Slices may be uneven: SmolLM2-135M has 3 KV heads, so at
TP = 2 one rank holds two query groups and the other one (the sums are the same).

Each rank's KV cache holds only its KV heads; all ranks use the same block ids, so rank 0's
scheduler decides for everyone and the other ranks replay its batch plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kernels.quant import Weight
from workers.model.config import ModelConfig
from workers.model.loader import Checkpoint, attention_for, check_device, describe
from workers.model.transformer import DecoderLayer, TransformerLM


def split_evenly(n: int, parts: int) -> list[range]:
    """`range(n)` in `parts` contiguous pieces, sizes differing by at most one."""
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} into {parts} non-empty parts")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


def shard_config(config: ModelConfig, rank: int, world: int) -> ModelConfig:
    kv = split_evenly(config.num_kv_heads, world)[rank]
    group = config.num_heads // config.num_kv_heads
    inter = split_evenly(config.intermediate_size, world)[rank]
    return replace(
        config, num_heads=len(kv) * group, num_kv_heads=len(kv), intermediate_size=len(inter)
    )


def row_parallel_inputs(config: ModelConfig, world: int) -> tuple[list[range], list[range]]:
    """Each rank's input features of the row-parallel projections: o_proj's (its query heads'
    outputs, whole query groups per KV head) and down_proj's (its intermediate units)."""
    group, d = config.num_heads // config.num_kv_heads, config.head_dim
    heads = split_evenly(config.num_kv_heads, world)
    columns = [range(kv.start * group * d, kv.stop * group * d) for kv in heads]
    return columns, split_evenly(config.intermediate_size, world)


def shard_weights(
    weights: dict[str, Weight], config: ModelConfig, rank: int, world: int
) -> dict[str, Weight]:
    """This rank's weights, under the same Hugging Face names, sliced for `shard_config`
    (a quantized row-parallel weight splits only at its blocks of 32 input features)."""
    kv = split_evenly(config.num_kv_heads, world)[rank]
    d = config.head_dim
    attention, units = (parts[rank] for parts in row_parallel_inputs(config, world))
    q_rows = torch.arange(attention.start, attention.stop)
    kv_rows = torch.arange(kv.start * d, kv.stop * d)
    mlp_rows = torch.arange(units.start, units.stop)
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        if ".self_attn.q_proj." in name:
            out[name] = w.index_select(0, q_rows)
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            out[name] = w.index_select(0, kv_rows)
        elif ".self_attn.o_proj." in name:
            out[name] = w.index_select(1, q_rows)
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            out[name] = w.index_select(0, mlp_rows)
        elif ".mlp.down_proj." in name:
            out[name] = w.index_select(1, mlp_rows)
        else:
            out[name] = w  # embeddings, norms, LM head: replicated
    return out


def build_sharded_model(
    checkpoint: Checkpoint,
    rank: int,
    world: int,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TransformerLM:
    """Rank `rank` of `world`: its slice of the weights, and `reduce` (a sum over the group)
    after the attention and MLP outputs. `reduce` may be set later (`model.reduce = ...`)."""
    check_device(checkpoint, device)
    attention = attention_for(device, dtype)
    if world == 1:
        model = TransformerLM(checkpoint.config, attention)
        model.load_hf_weights(checkpoint.weights)
    else:
        config = shard_config(checkpoint.config, rank, world)
        model = TransformerLM(config, attention)
        model.load_hf_weights(shard_weights(checkpoint.weights, checkpoint.config, rank, world))
    model = describe(model.to(device=device, dtype=dtype).eval())
    model.reduce = reduce
    return model


MAX_EMULATED_WORLD = 2  # the largest group whose sums one process reproduces


def emulate_row_parallel(model: TransformerLM, world: int) -> None:
    """Make the whole `model` compute its row-parallel projections (o_proj, down_proj) as a
    group of `world` ranks does: each rank's partial sum from its own input columns, with the
    same kernel on the same slice of the weight, and the partials added in the activations'
    dtype in rank order, as the group's all-reduce adds them. Everything else a rank computes
    (its heads' Q/K/V and attention, its MLP units, the replicated norms and embeddings) is
    the same bits in one process on our row-independent CPU kernels, so a prefill worker
    emulating the verifiers' degree hands them the K/V and features their own prefill would
    have made (for two ranks: the all-reduce's a + b rounds once whatever the order).
    `world` 1 undoes it. Groups of more than two ranks are refused: gloo's all-reduce then adds
    the partials in an order that is not even the same on every rank (measured: ranks 2 and 3
    of four hold other bits than ranks 0 and 1), which one process cannot reproduce."""
    if world > MAX_EMULATED_WORLD:
        raise ValueError(
            f"a group of {world} ranks cannot be emulated bit for bit in one process "
            f"(at most {MAX_EMULATED_WORLD})"
        )
    columns, units = row_parallel_inputs(model.config, world)
    model.layers_changed()
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        if world == 1:
            attn.row_parts, mlp.row_parts = [], []
            continue
        attn.row_parts = [(c, _columns(attn.o_proj.weight, c)) for c in columns]
        mlp.row_parts = [(u, _columns(mlp.down_proj.weight, u)) for u in units]


def _columns(weight: Weight, columns: range) -> Weight:
    """The input features `columns` of a projection's weight, as a rank holds them."""
    if isinstance(weight, torch.Tensor):
        return weight.detach()[:, columns.start : columns.stop].contiguous()
    return weight.index_select(1, torch.arange(columns.start, columns.stop))
