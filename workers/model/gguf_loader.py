"""Read a GGUF file: config, weights under Hugging Face names, tokenizer.

Weights are dequantized to floats, or, with `keep_quantized`, the 2-D weights (projections, and
the token embedding a tied LM head projects with) stored in a block type our kernels read
(kernels/quant.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are kept in their blocks, and those of Q4_K,
Q5_K and Q6_K held in those kinds (`quant_gguf.CONVERTED`); other types are dequantized.

llama.cpp's converter permutes the rows of llama Q and K weights so its interleaved rotary
variant can run on them; we undo that so every model uses the rotate-half layout of
kernels/rotary.py. Qwen2 and Qwen3 files are written with the rotate-half ("neox") layout and
need nothing. Mistral's files are `llama` ones. Llama 3's rope scaling is stored as a
`rope_freqs` tensor of per-frequency divisors (not a weight: it goes into the config), linear
and YaRN scaling as `rope.scaling.*` fields.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from kernels.quant import KINDS, QuantizedWeight, Weight
from kernels.quant_gguf import CONVERTED, from_gguf_tensor
from kernels.rotary import RopeScaling
from workers.model.config import ModelConfig
from workers.model.tokenizer import GGUFTokenizerSpec, Tokenizer

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3's per-frequency rope divisors
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2)
    if prefix != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_LAYER_NAMES[rest]}"


def unpermute_qk(weight: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's Q/K row permutation (rows `[head, 2, half]` back to `[head, half, 2]`)."""
    rows = weight.shape[0]
    if isinstance(weight, QuantizedWeight):
        order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2)
        return weight.index_select(0, order.transpose(1, 2).reshape(rows))
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    eos = [
        _field(reader, "tokenizer.ggml.eos_token_id"),
        _field(reader, "tokenizer.ggml.eot_token_id"),
    ]
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    window = _field(reader, f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=str(_field(reader, "general.name", "")),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=read_rope_scaling(reader, arch),
        sliding_window=int(window) if window else None,
    )


def read_rope_scaling(reader: GGUFReader, arch: str) -> RopeScaling | None:
    """The file's rope scaling: a `rope_freqs` tensor (Llama 3's, as llama.cpp writes it), or
    the `rope.scaling.*` fields (linear, yarn); None for plain rotary."""
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in factors))
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind != "yarn":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: linear, yarn")
    attention = _field(reader, f"{arch}.rope.scaling.attn_factor")
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_positions=int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
        beta_fast=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=float(attention) if attention else _yarn_mscale(factor),
    )


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def read_weights(
    reader: GGUFReader,
    config: ModelConfig,
    progress: bool = False,
    dtype: torch.dtype | None = None,
    keep_quantized: bool = False,
) -> dict[str, Weight]:
    """Every tensor dequantized to fp32 (or kept as stored when already float), HF names; with
    `dtype`, each one cast to it as soon as it is read. With `keep_quantized`, the 2-D weights
    in a block type of kernels/quant.py stay in their blocks (`QuantizedWeight`)."""
    weights: dict[str, Weight] = {}
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress):
        if tensor.name == _ROPE_FREQS:
            continue  # read into the config (read_rope_scaling)
        name = hf_name(tensor.name)
        kind = tensor.tensor_type.name.lower()
        weight: Weight
        held = kind in KINDS or kind in CONVERTED
        if keep_quantized and held and len(tensor.shape) == 2:
            weight = from_gguf_tensor(kind, tensor.data, int(tensor.shape[0]))
        else:
            weight = cast(_dequantize(tensor), dtype)
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_qk(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_qk(weight, config.num_kv_heads)
        weights[name] = weight
    return weights


def cast(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating-point weight in `dtype` (None: unchanged); integer tensors stay as they are."""
    if dtype is None or not weight.is_floating_point():
        return weight
    return weight.to(dtype)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a writable copy


def read_tokenizer_spec(reader: GGUFReader) -> GGUFTokenizerSpec:
    return GGUFTokenizerSpec(
        model=str(_field(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=_field(reader, "tokenizer.ggml.tokens"),
        token_types=_field(reader, "tokenizer.ggml.token_type", []),
        merges=_field(reader, "tokenizer.ggml.merges", []),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        eot_token_id=_field(reader, "tokenizer.ggml.eot_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def cache_root() -> Path:
    """Where Outrider keeps derived files: $OUTRIDER_CACHE_DIR, else the XDG cache folder."""
    if root := os.environ.get("OUTRIDER_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "outrider"


def load_gguf_tokenizer(path: Path, reader: GGUFReader) -> Tokenizer:
    """The file's tokenizer, built once and then read from the cache (keyed by file identity)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_root() / "tokenizers" / key[:24]
    if (cached / "tokenizer.json").is_file():
        return Tokenizer.from_directory(cached)
    tokenizer = Tokenizer.from_gguf_spec(read_tokenizer_spec(reader))
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent))
    tokenizer.save(staging)
    try:
        staging.rename(cached)  # atomic: a concurrent start sees all of it or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return tokenizer
