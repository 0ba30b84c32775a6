"""A model whose projections are held in quantized blocks: loading (GGUF blocks, int8 at load,
biases), tensor-parallel slices, and where such weights may run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import native
from workers.model.config import ModelConfig
from workers.model.loader import (
    Checkpoint,
    build_model,
    check_device,
    load_checkpoint,
    resolve_quantization,
    save_safetensors_dir,
)
from workers.model.tensor_parallel import shard_weights
from workers.model.transformer import QuantizedEmbedding, QuantizedLinear, _hf_names

CONFIG = ModelConfig(
    architecture="qwen2",  # q/k/v biases
    vocab_size=96,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    attention_bias=True,
)


def _random_checkpoint(tokenizer) -> Checkpoint:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name in sorted(_hf_names(CONFIG)):
        shape = _shape(name)
        scale = 1.0 if name.endswith("norm.weight") else shape[-1] ** -0.5
        base = torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)
        weights[name] = base + torch.randn(shape, generator=gen) * scale * 0.5
    return Checkpoint(CONFIG, weights, tokenizer)


def _shape(name: str) -> tuple[int, ...]:
    h, kv = CONFIG.hidden_size, CONFIG.kv_size
    if "embed_tokens" in name:
        return (CONFIG.vocab_size, h)
    if name.endswith("norm.weight"):
        return (h,)
    rows = {"q_proj": CONFIG.q_size, "k_proj": kv, "v_proj": kv, "o_proj": h}
    rows |= {"gate_proj": CONFIG.intermediate_size, "up_proj": CONFIG.intermediate_size}
    rows["down_proj"] = h
    proj = name.split(".")[-2]
    if name.endswith("bias"):
        return (rows[proj],)
    cols = (
        CONFIG.intermediate_size
        if proj == "down_proj"
        else (CONFIG.q_size if proj == "o_proj" else h)
    )
    return (rows[proj], cols)


@pytest.mark.slow  # reads the bundled tokenizer
def test_int8_at_load_keeps_the_model_close_and_its_biases(tmp_path: Path, checkpoint) -> None:  # type: ignore[no-untyped-def]
    floats = _random_checkpoint(checkpoint.tokenizer)
    save_safetensors_dir(floats, tmp_path / "model")
    quantized = load_checkpoint(tmp_path / "model", quantization="int8")
    model = build_model(quantized, dtype=torch.float32)
    reference = build_model(floats, dtype=torch.float32)
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear) and attn.qkv_proj.bias is not None
    assert isinstance(model.embed_tokens, QuantizedEmbedding)  # the tied LM head's weight
    assert model.quantized_kinds() == {"q8_0": 2 * 4 + 1}
    assert model.step_weight_bytes() < reference.step_weight_bytes() / 3
    torch.testing.assert_close(
        attn.qkv_proj.bias, reference.layers[0].self_attn.qkv_proj.bias, rtol=0, atol=0
    )
    from tests.model.helpers import all_logits

    tokens = list(range(1, 40))
    got, want = all_logits(model, tokens), all_logits(reference, tokens)
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_tensor_parallel_slices_of_quantized_weights_add_up() -> None:
    from kernels import quant_gguf

    gen = torch.Generator().manual_seed(1)
    o_proj = torch.randn(CONFIG.hidden_size, CONFIG.q_size, generator=gen)
    down = torch.randn(CONFIG.hidden_size, CONFIG.intermediate_size, generator=gen)
    weights = {
        "model.layers.0.self_attn.o_proj.weight": quant_gguf.quantize(o_proj, "q4_1"),
        "model.layers.0.mlp.down_proj.weight": quant_gguf.quantize(down, "q8_0"),
    }
    full = {name: w.dequantize() for name, w in weights.items()}
    parts = [shard_weights(weights, CONFIG, rank, 2) for rank in range(2)]
    for name in weights:
        pieces = [p[name].dequantize() for p in parts]  # type: ignore[union-attr]
        assert torch.equal(torch.cat(pieces, dim=1), full[name])  # row-parallel: by columns


def test_where_quantized_weights_may_run(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    folder = tmp_path / "hf"
    expected_auto = "gguf" if native.available() else "none"
    assert resolve_quantization("auto", gguf, "cpu") == expected_auto
    assert resolve_quantization("auto", gguf, "cuda") == "none"
    assert resolve_quantization("auto", folder, "cpu") == "none"
    assert resolve_quantization("int8", folder, "cpu") == "int8"
    with pytest.raises(ValueError, match="not one"):
        resolve_quantization("gguf", folder, "cpu")
    with pytest.raises(ValueError, match="runs on CPUs"):
        resolve_quantization("int8", folder, "cuda")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_quantization("q4", gguf, "cpu")
    from kernels import quant_gguf

    held = Checkpoint(CONFIG, {"w": quant_gguf.quantize(torch.randn(4, 64), "q8_0")}, None)  # type: ignore[arg-type]
    check_device(held, "cpu")
    with pytest.raises(ValueError, match="run on CPUs"):
        check_device(held, "cuda")
