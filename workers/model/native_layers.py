"""A model's decoder layers in one native call each (kernels/csrc/decoder_layer.c), where every
layer is a Llama-style layer the CPU kernels run: bf16 activations, projections in quantized
blocks, our paged attention. The call runs the six kernels `DecoderLayer.forward` calls, in
the same order on the same rows, so a forward's logits are the same bits either way; it saves
the interpreter, torch and ctypes between them, which at one sequence's decode step on two
cores cost about as much as the kernels did.

`NativeLayers.of(model)` says whether a model's layers qualify (made once, when a forward
first asks); `run` then takes a forward's layers, or returns None where this forward cannot
(a draft tree, a backend other than NativeCpuAttention, tensors the kernels refuse), and the
model runs its layers in Python as before."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import native
from kernels.attention import AttentionBackend, AttentionMetadata, NativeCpuAttention
from kernels.quant import QuantizedWeight
from kernels.rotary import RotaryAngles

if TYPE_CHECKING:
    from workers.model.transformer import TransformerLM

_ptr, _int, _float, _long = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64


class _Projection(ctypes.Structure):  # decoder_layer.c od_projection
    _fields_ = [
        ("codes", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("bias", _ptr),
        ("min_per_scale", _int),
        ("bits", _int),
        ("in_features", _int),
        ("out_features", _int),
    ]


class _Layer(ctypes.Structure):  # od_layer
    _fields_ = [
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("eps", _float),
        ("scale", _float),
        ("num_heads", _int),
        ("kv_heads", _int),
        ("head_dim", _int),
    ]


class _Forward(ctypes.Structure):  # od_forward
    _fields_ = [
        ("rows", _int),
        ("threads", _int),
        ("num_seqs", _int),
        ("table_stride", _int),
        ("block_size", _int),
        ("table_rows", _long),
        ("num_slots", _long),
        ("positions", _ptr),
        ("slots", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("block_tables", _ptr),
        ("q_starts", _ptr),
        ("q_lens", _ptr),
        ("seq_lens", _ptr),
        ("stream", _ptr),
        ("qkv", _ptr),
        ("attn", _ptr),
        ("attn_o", _ptr),
        ("gate_up", _ptr),
    ]


def _projection(weight: object, bias: torch.Tensor | None) -> _Projection | None:
    """`weight`'s blocks as the kernel reads them (pointers into tensors the weight holds)."""
    if type(weight) is not QuantizedWeight:
        return None
    args = weight.kernel_args()
    return _Projection(
        args.codes,
        args.scales,
        args.mins,
        None if bias is None else bias.data_ptr(),
        args.min_per_scale,
        args.bits,
        args.in_features,
        args.out_features,
    )


@dataclass(slots=True)
class NativeLayers:
    """Each layer's `od_layer`, and what its pointers point into, kept alive with it (a
    weight replaced without `TransformerLM.layers_changed` is then read stale, never freed)."""

    layers: list[_Layer]
    addresses: list[int]
    keep: list[object]
    qkv_out: int
    gate_up_out: int
    hidden: int
    q_size: int

    @staticmethod
    def of(model: TransformerLM) -> NativeLayers | None:
        """The model's layers as decoder_layer.c takes them, or None where one does not fit
        (float or unquantized projections, the row-parallel emulation, Qwen3's head norms,
        batch-invariant kernels, a model not in bf16, no native kernels). A tensor-parallel
        rank's model, whose `reduce` may be set after it is built, never asks
        (`TransformerLM.forward`)."""
        from workers.model.transformer import DecoderLayer

        if model.dtype != torch.bfloat16 or not native.available():
            return None
        layers: list[_Layer] = []
        keep: list[object] = []
        for layer in model.layers:
            if type(layer) is not DecoderLayer:  # a subclass computes otherwise (EAGLE's)
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or attn.row_parts or mlp.row_parts:
                return None
            if attn.packs.batch_invariant or mlp.packs.batch_invariant:
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(n.dtype != torch.bfloat16 or not n.is_contiguous() for n in norms):
                return None
            if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
                return None
            biases = [_bf16(attn.qkv_proj.bias), _bf16(mlp.gate_up_proj.bias)]
            keep += [*norms, *(b for b in biases if b is not None)]
            parts = (
                _projection(attn.qkv_proj.weight, biases[0]),
                _projection(attn.o_proj.weight, None),  # DecoderLayer projects it unbiased
                _projection(mlp.gate_up_proj.weight, biases[1]),
                _projection(mlp.down_proj.weight, None),
            )
            if any(p is None for p in parts):
                return None
            keep += [attn.qkv_proj.weight, attn.o_proj.weight]
            keep += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
            layers.append(
                _Layer(
                    *parts,
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    layer.input_layernorm.eps,
                    attn.scale,
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                )
            )
        if not layers:
            return None
        first = layers[0]
        return NativeLayers(
            layers,
            [ctypes.addressof(x) for x in layers],
            keep,
            first.qkv.out_features,
            first.gate_up.out_features,
            first.o.out_features,
            first.num_heads * first.head_dim,
        )

    def run(
        self,
        h: torch.Tensor,  # [rows, hidden]: the embedded tokens, overwritten
        angles: RotaryAngles,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        plan: object,
        after_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (MLP output, stream before it), as the Python layers return them,
        with `after_layer(i, h, residual)` called after each; None, with nothing run, where this
        forward's tensors or attention do not fit the kernels."""
        if type(backend) is not NativeCpuAttention or meta.tree is not None:
            return None
        rows = h.shape[0]
        positions, slots = angles.positions, meta.slot_mapping
        if (
            h.dtype != torch.bfloat16
            or not h.is_contiguous()
            or h.shape[1] != self.hidden
            or positions.dtype != torch.int64
            or slots.dtype != torch.int64
            or positions.shape != (rows,)
            or slots.shape != (rows,)
            or not native.grad_free(h)
        ):
            return None
        key0, value0 = kv_caches[0]
        qkv = torch.empty(rows, self.qkv_out, dtype=torch.bfloat16)
        cos, sin = angles.cos_table, angles.sin_table
        if (
            native.rotary_kv_problem(qkv, cos, key0, value0) is not None
            or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            return None
        head_dim = key0.shape[3]
        query = qkv.view(rows, -1, head_dim)[:, : self.q_size // head_dim]
        settled = backend.native_tables(plan, query, key0, value0)
        if settled is None:
            return None
        tables, starts, lens, seq_lens = settled
        positions, slots = positions.contiguous(), slots.contiguous()
        stream = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        attn = torch.empty(rows, self.q_size, dtype=torch.bfloat16)
        attn_o = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        gate_up = torch.empty(rows, self.gate_up_out, dtype=torch.bfloat16)
        residual = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        forward = _Forward(
            rows,
            torch.get_num_threads(),
            seq_lens.shape[0],
            tables.stride(0),
            key0.shape[1],
            cos.shape[0],
            key0.shape[0] * key0.shape[1],
            positions.data_ptr(),
            slots.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tables.data_ptr(),
            starts.data_ptr(),
            lens.data_ptr(),
            seq_lens.data_ptr(),
            stream.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            attn_o.data_ptr(),
            gate_up.data_ptr(),
        )
        call = native.library().outrider_decoder_layer
        at, h_at, residual_at = ctypes.addressof(forward), h.data_ptr(), residual.data_ptr()
        for i, layer_at in enumerate(self.addresses):
            key, value = kv_caches[i]
            first = i == 0
            code = call(
                layer_at,
                at,
                key.data_ptr(),
                value.data_ptr(),
                h_at,
                None if first else residual_at,
                residual_at if first else None,
            )
            if code == 1:
                raise MemoryError("a decoder layer's kernels could not allocate their scratch")
            if code == 2:
                raise IndexError("a position or a slot is outside the rotary tables or the cache")
            after_layer(i, h, residual)
        return h, residual


def _bf16(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.to(torch.bfloat16).contiguous()
