"""Small models of every architecture we serve, written to disk as users bring them: a Hugging
Face folder (config.json, model.safetensors, the tokenizer) and a GGUF file written with the
`gguf` package the way llama.cpp's converter writes one (llama Q/K rows permuted for its
interleaved rotary, Llama 3's rope scaling as a `rope_freqs` tensor). Random weights, the
bundled model's tokenizer where a test serves them (`small_config(vocab_size=VOCAB)`, whose
text a server can read); a vocabulary of 512 where only logits matter, which keeps the files
and their reading quick.

`ARCH_CASES` names one config for each architecture and rope scaling; transformers builds each
from its `to_hf_config()` as the oracle."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from kernels.rotary import RopeScaling
from tests.factories import random_hf_weights
from workers.model.config import ModelConfig
from workers.model.gguf_loader import read_tokenizer_spec
from workers.model.loader import bundled_model_path, load_tokenizer
from workers.model.tokenizer import Tokenizer

VOCAB = 49152  # the bundled tokenizer's
SMALL_VOCAB = 512


def small_config(architecture: str, **overrides: object) -> ModelConfig:
    """A two-layer model our native CPU kernels take whole (head_dim 32, rows of 32s)."""
    fields: dict[str, object] = {
        "architecture": architecture,
        "vocab_size": SMALL_VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": architecture == "qwen2",
        "qk_norm": architecture == "qwen3",
        "bos_token_id": 1,
        "eos_token_ids": (2,),
        "name": f"tiny-{architecture}",
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


# Rope scaling that bites within a few hundred positions: a pretraining context of 64.
LLAMA3_ROPE = RopeScaling(
    "llama3", factor=8.0, original_max_positions=64, low_freq_factor=1.0, high_freq_factor=4.0
)
ARCH_CASES: dict[str, ModelConfig] = {
    "llama3.1": small_config("llama", rope_scaling=LLAMA3_ROPE),
    "llama3.2-tied": small_config("llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-linear": small_config("llama", rope_scaling=RopeScaling("linear", factor=4.0)),
    "llama-yarn": small_config(
        "llama",
        rope_scaling=RopeScaling(
            "yarn", factor=8.0, original_max_positions=64, attention_factor=0.1 * math.log(8) + 1
        ),
    ),
    # 8 query heads of 32 make 256 columns over a hidden size of 128, as Qwen3's do.
    "qwen3": small_config("qwen3", num_heads=8, tie_word_embeddings=True),
    "qwen2": small_config("qwen2"),
    "mistral": small_config("mistral", sliding_window=384),
}


def model_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names (tests/factories.py)."""
    return random_hf_weights(config, seed=seed)


def write_hf_folder(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> Path:
    """config.json, model.safetensors and the bundled tokenizer, as a hub download has them."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    bundled_tokenizer().save(path)
    return path


@functools.cache
def bundled_tokenizer() -> Tokenizer:
    return load_tokenizer()


# GGUF tensor names, written independently of the loader's table (workers/model/gguf_loader.py).
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    if rest.startswith("self_attn.") and rest[10:12] in ("q_", "k_", "v_") and "_proj." in rest:
        return f"blk.{layer}.attn_{rest[10]}.{rest.rsplit('.', 1)[1]}"
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def _permute_for_llama_cpp(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order for its interleaved rotary."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(head_dim: int, theta: float, s: RopeScaling) -> list[float]:
    """What llama.cpp's converter writes as `rope_freqs` for Llama 3's scaling: each
    frequency's divisor (1 for short wavelengths, `factor` for long ones, a blend between)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < s.original_max_positions / s.high_freq_factor:
            factors.append(1.0)
        elif wavelen > s.original_max_positions / s.low_freq_factor:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    return factors


def write_gguf(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    path: Path,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    tokenizer: bool = True,
) -> dict[str, torch.Tensor]:
    """A GGUF file of this model, its 2-D weights in `quant` (norms stay F32), with the bundled
    tokenizer unless `tokenizer` is false. Returns the weights as stored (dequantized), which
    is what a reader of the file gets."""
    arch = "llama" if config.architecture == "mistral" else config.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    if tokenizer:
        _write_tokenizer(writer, config)
    stored: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        array = w.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _permute_for_llama_cpp(w.float(), config.num_heads).numpy()
        elif arch == "llama" and ".k_proj." in name:
            array = _permute_for_llama_cpp(w.float(), config.num_kv_heads).numpy()
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            packed = gguf.quants.quantize(array, quant)
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=quant)
            array = gguf.quants.dequantize(packed, quant).reshape(array.shape)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
        stored[name] = _unpermuted(torch.from_numpy(np.array(array)), name, config, arch)
    if config.rope_scaling is not None and config.rope_scaling.kind == "llama3":
        factors = llama3_freq_factors(config.head_dim, config.rope_theta, config.rope_scaling)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _unpermuted(w: torch.Tensor, name: str, config: ModelConfig, arch: str) -> torch.Tensor:
    if arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return w
    heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_metadata(writer: gguf.GGUFWriter, config: ModelConfig, arch: str) -> None:
    writer.add_name(config.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling.kind))
        writer.add_rope_scaling_factor(scaling.factor)
    if scaling is not None and scaling.kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_positions)
        writer.add_rope_scaling_attn_factors(scaling.attention_factor)


def _write_tokenizer(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    spec = read_tokenizer_spec(gguf.GGUFReader(bundled_model_path()))
    writer.add_tokenizer_model(spec.model)
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    writer.add_token_merges(spec.merges)
    writer.add_bos_token_id(config.bos_token_id or 1)
    writer.add_eos_token_id(config.eos_token_ids[0])
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)
