"""Every architecture and rope scaling we serve against transformers' own classes, in fp32:
through a Hugging Face folder and through GGUF files written as llama.cpp writes them (dense
and Q8_0), logits over 300 positions (rope scaling bites past 64) and greedy tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGUFReader

from tests.factories import random_hf_weights, tiny_config
from tests.model.helpers import all_logits, plain_tokens
from tests.model_files import (
    ARCH_CASES,
    SMALL_VOCAB,
    bundled_tokenizer,
    model_weights,
    write_gguf,
    write_hf_folder,
)
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.config import ModelConfig
from workers.model.gguf_loader import read_config, read_weights
from workers.model.loader import Checkpoint, build_model, load_checkpoint
from workers.model.transformer import TransformerLM

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, SMALL_VOCAB, (300,), generator=torch.Generator().manual_seed(2)).tolist()
QUANTS = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def oracle(config: ModelConfig, weights: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def read_gguf(path: Path, keep_quantized: bool) -> Checkpoint:
    """What load_checkpoint reads of a GGUF file (quantization none or gguf), the tokenizer
    aside (these files have none)."""
    reader = GGUFReader(path)
    config = read_config(reader)
    weights = read_weights(reader, config, keep_quantized=keep_quantized)
    return Checkpoint(config, weights, bundled_tokenizer())


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err < 2e-5, err


@pytest.fixture(scope="module", params=list(ARCH_CASES))
def case(request, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    config = ARCH_CASES[request.param]
    weights = model_weights(config, seed=1)
    folder = write_hf_folder(config, weights, tmp_path_factory.mktemp(request.param))
    return request.param, config, weights, folder


def test_hf_folder_matches_transformers(case) -> None:  # type: ignore[no-untyped-def]
    """transformers reads the folder itself; we read it through load_checkpoint."""
    _, config, _, folder = case
    checkpoint = load_checkpoint(folder)
    assert checkpoint.config == config
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    theirs = hf_logits(hf.eval(), IDS)
    assert_close(all_logits(build_model(checkpoint), IDS), theirs)
    if config.rope_scaling is not None:  # the scaling is what makes them agree
        plain = TransformerLM(dataclasses.replace(config, rope_scaling=None))
        plain.load_hf_weights(checkpoint.weights)
        assert float((all_logits(plain.eval(), IDS) - theirs).abs().max()) > 1e-2


@pytest.mark.parametrize("quant", list(QUANTS))
def test_gguf_matches_transformers(case, quant: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A GGUF of the same model (llama's Q/K permuted, Llama 3's scaling as rope_freqs):
    read back dequantized, it is the model transformers builds from the stored weights; kept in
    its Q8_0 blocks (what a CPU serves: activations rounded to int8 too), near it (on random
    weights the existing llama and qwen2 paths are as near: 5% mean error, 90% of argmaxes)."""
    name, config, weights, _ = case
    path = tmp_path / f"{name}.gguf"
    stored = write_gguf(config, weights, path, QUANTS[quant], tokenizer=False)
    dense = read_gguf(path, keep_quantized=False)
    kind = None if config.rope_scaling is None else config.rope_scaling.kind
    read = dense.config.rope_scaling
    assert (read and read.kind) == ("freq_factors" if kind == "llama3" else kind)
    theirs = hf_logits(oracle(config, stored), IDS)
    assert_close(all_logits(build_model(dense), IDS), theirs)
    if quant == "q8_0":
        blocks = build_model(read_gguf(path, keep_quantized=True))
        assert blocks.quantized_kinds()
        ours = all_logits(blocks, IDS)
        err = float((ours - theirs).abs().mean() / theirs.abs().mean())
        assert err < 0.1, err


def test_greedy_tokens_equal_transformers_generate(case) -> None:  # type: ignore[no-untyped-def]
    name, config, weights, _ = case
    hf = oracle(config, weights)
    ours = TransformerLM(config)
    ours.load_hf_weights(weights)
    prompts = [IDS[:5], IDS[100:140], IDS[7:70]]
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    got = plain_tokens(ours.eval(), (), prompts, greedy)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=None
            )
        assert tokens == out[0, len(prompt) :].tolist(), name


def test_a_sliding_window_is_served_up_to_the_window() -> None:
    """Mistral with a 384-token window on a 512-token model: served up to 384 tokens, where
    attention sees every key as transformers' windowed mask does; longer is refused."""
    config = ARCH_CASES["mistral"]
    assert (config.max_position_embeddings, config.max_context) == (512, 384)
    model = TransformerLM(config)
    model.load_hf_weights(model_weights(config))
    engine = SequentialEngine(model, eos_token_ids=())
    with pytest.raises(ValueError, match="384"):
        engine.generate((IDS * 2)[:390], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "gemma2"}, "supported: llama, mistral, qwen2, qwen3"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        ({"rope_scaling": {"type": "linear"}}, "needs a factor"),
    ],
)
def test_what_we_cannot_serve_is_refused_naming_what_we_can(
    fields: dict[str, object], message: str
) -> None:
    cfg = tiny_config().to_hf_config()
    cfg.pop("rope_parameters")
    cfg.update(fields)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(cfg)


def test_weights_that_do_not_fit_the_config_are_rejected() -> None:
    config = tiny_config("qwen2")
    weights = random_hf_weights(config)
    del weights["model.layers.0.self_attn.q_proj.bias"]
    with pytest.raises(ValueError, match="missing"):
        TransformerLM(config).load_hf_weights(weights)
    config = tiny_config("qwen3")
    weights = random_hf_weights(config)
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match="k_norm"):
        TransformerLM(config).load_hf_weights(weights)
