"""Weights read from GGUF's quantized blocks into the kinds kernels/quant.py holds: a tensor's
bytes as the file stores them (`from_gguf_blocks`, `from_gguf_tensor`: K-quants converted), and
a float weight quantized as llama.cpp quantizes it (`quantize`, gguf's own quantizer)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.quant import BLOCK, KINDS, WITH_MINS, QuantizedWeight, from_codes

_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}  # scales included


def from_gguf_blocks(kind: str, raw: np.ndarray, in_features: int) -> QuantizedWeight:
    """A weight from a GGUF tensor's bytes (`[out, blocks * block bytes]` uint8)."""
    if kind not in KINDS:
        raise ValueError(f"no quantized weights of kind {kind}")
    out = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(out, in_features // BLOCK, _BLOCK_BYTES[kind])
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    mins = None
    if kind in WITH_MINS:
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    if kind == "q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy()) ^ 0x80  # signed q -> q + 128
        return from_codes(kind, codes.reshape(out, in_features), scales, mins)
    if KINDS[kind] == 5:  # [d, (m), fifth bits (32, little-endian), 16 bytes of pairs]
        at = 4 if kind == "q5_1" else 2
        fifth = torch.from_numpy(blocks[..., at : at + 4].copy()).to(torch.int64)
        bits = (fifth[..., :, None] >> torch.arange(8)) & 1  # [out, blocks, 4 bytes, 8]
        pairs = torch.from_numpy(blocks[..., at + 4 :].copy()).to(torch.int64)
        low = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)  # elements 0-15, then 16-31
        codes = low | (bits.reshape(out, -1, 32) << 4)
        return from_codes(kind, codes.to(torch.uint8).reshape(out, in_features), scales, mins)
    pairs = torch.from_numpy(blocks[..., blocks.shape[-1] - 16 :].copy())  # [out, blocks, 16]
    codes = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)  # elements 0-15, then 16-31
    return from_codes(kind, codes.reshape(out, in_features), scales, mins)


# GGUF block types held in the kernel's kinds: type -> kind. Q4_K and Q5_K keep their codes with
# each sub-block of 32's scale d sc and minimum dmin m rounded to fp16 (within 2^-11 of
# llama.cpp's fp32 products); Q6_K (sub-blocks of 16 with their own scales) is requantized to
# 8-bit blocks of 32 from its values. Other types (Q2_K, Q3_K, IQ*) are dequantized to floats by
# the loader.
CONVERTED = {"q4_k": "q4_1", "q5_k": "q5_1", "q6_k": "q8_0"}


def from_gguf_tensor(kind: str, raw: np.ndarray, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's bytes (`[out, row bytes]` uint8) of block type `kind` (lower case: a
    kernel kind or one of CONVERTED) as a weight in the kernel's kinds."""
    if kind in KINDS:
        return from_gguf_blocks(kind, raw, in_features)
    out = raw.shape[0]
    if kind == "q4_k":
        return _from_k_quant(np.ascontiguousarray(raw).reshape(-1, 144), out, in_features)
    if kind == "q5_k":
        return _from_k_quant(np.ascontiguousarray(raw).reshape(-1, 176), out, in_features)
    if kind == "q6_k":
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(out, in_features)
        return quantize(torch.from_numpy(np.array(values, dtype=np.float32)), "q8_0")
    raise ValueError(f"GGUF type {kind} is not held in quantized blocks here")


def _from_k_quant(blocks: np.ndarray, out: int, in_features: int) -> QuantizedWeight:
    """Q4_K (144 bytes a super-block) or Q5_K (176: the fifth bits before the pairs) in the
    Q4_1 or Q5_1 kind: sub-blocks of 32 with their own scale and minimum."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [super-blocks, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [super-blocks, 8] each
    scales = torch.from_numpy((d * sc.astype(np.float32)).astype(np.float16))
    mins = torch.from_numpy((-dmin * m.astype(np.float32)).astype(np.float16))
    five = blocks.shape[1] == 176
    qs = torch.from_numpy(blocks[:, 48 if five else 16 :].copy()).view(-1, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2)  # [super-blocks, 4, 2, 32]: sub-block order
    if five:  # bit 2c (2c + 1) of byte j: the fifth bit of element j of sub-block 2c (2c + 1)
        high = torch.from_numpy(blocks[:, 16:48].copy())  # [super-blocks, 32]
        shifts = torch.arange(8).view(1, 4, 2, 1)
        codes = codes | (((high.view(-1, 1, 1, 32) >> shifts) & 1) << 4)
    blocks_per_row = in_features // BLOCK
    return from_codes(
        "q5_1" if five else "q4_1",
        codes.to(torch.uint8).reshape(out, in_features),
        scales.reshape(out, blocks_per_row),
        mins.reshape(out, blocks_per_row),
    )


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """A float `[out, in]` weight quantized as llama.cpp quantizes it (gguf's own quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind not in KINDS:
        raise ValueError(f"quantized kind must be one of {', '.join(KINDS)}, not {kind}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a weight's {tuple(weight.shape)} in features are not blocks of {BLOCK}")
    qtype = GGMLQuantizationType[kind.upper()]
    raw = gguf_quantize(weight.detach().float().cpu().numpy(), qtype)
    return from_gguf_blocks(kind, raw, weight.shape[1])
