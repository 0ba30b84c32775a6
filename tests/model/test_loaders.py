"""GGUF and safetensors loading, the tokenizer and its cache, the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.helpers import all_logits
from workers.model import gguf_loader
from workers.model.loader import (
    build_model,
    bundled_model_path,
    load_checkpoint,
    load_config,
    load_tokenizer,
    resolve_model_path,
    save_safetensors_dir,
)

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world! How are you today?",
    "In 2024 we sold 1234567 units at $3.99 each.",
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café 日本語 🙂 — “quotes”",
    "  spaces   and\n\nnewlines\t tabs",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_bundled_gguf_config(checkpoint) -> None:  # type: ignore[no-untyped-def]
    c = checkpoint.config
    assert (c.architecture, c.vocab_size, c.num_layers, c.hidden_size) == ("llama", 49152, 30, 576)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == (2,)
    assert "lm_head.weight" not in checkpoint.weights


def test_safetensors_dir_loads_the_same_weights(checkpoint, model_fp32, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    save_safetensors_dir(checkpoint, tmp_path / "smol")
    again = load_checkpoint(tmp_path / "smol")
    assert again.config == checkpoint.config
    assert again.weights.keys() == checkpoint.weights.keys()
    for name, weight in checkpoint.weights.items():
        assert torch.equal(again.weights[name], weight), name
    for text in TEXTS:
        assert again.tokenizer.encode(text) == checkpoint.tokenizer.encode(text)
    assert again.tokenizer.chat_template == checkpoint.tokenizer.chat_template
    ids = checkpoint.tokenizer.encode(TEXTS[0])
    assert torch.equal(all_logits(build_model(again), ids), all_logits(model_fp32, ids))


def test_tokenizer_alone_is_the_checkpoints(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`load_tokenizer` (what a router loads, no weights) from the GGUF and from an HF folder."""
    save_safetensors_dir(checkpoint, tmp_path / "smol")
    for tokenizer in (load_tokenizer(), load_tokenizer(tmp_path / "smol")):
        for text in TEXTS:
            assert tokenizer.encode(text) == checkpoint.tokenizer.encode(text)
        assert tokenizer.eos_token_ids == checkpoint.tokenizer.eos_token_ids
        assert tokenizer.chat_template == checkpoint.tokenizer.chat_template
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_tokenizer(tmp_path)


def test_safetensors_dir_is_real_hf_layout(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    save_safetensors_dir(checkpoint, tmp_path / "smol")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "smol"), dtype=torch.float32
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "smol"))
    assert hf_tok.encode(TEXTS[2]) == checkpoint.tokenizer.encode(TEXTS[2])
    ids = checkpoint.tokenizer.encode(TEXTS[0])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    ours = all_logits(build_model(checkpoint), ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_tokenizer_matches_transformers(checkpoint, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [1]  # special tokens written in text stay whole


def test_digits_are_split_one_by_one(checkpoint) -> None:  # type: ignore[no-untyped-def]
    # llama.cpp's "smollm" pre-tokenizer isolates each digit before the GPT-2 split.
    ids = checkpoint.tokenizer.encode("12345")
    assert [checkpoint.tokenizer.decode([i]) for i in ids] == list("12345")


def test_chat_template_matches_transformers(checkpoint, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        ours = checkpoint.tokenizer.apply_chat_template(messages)
        theirs = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs
    # An answer begun in the last message, continued (vLLM's continue_final_message).
    started = [*conversations[1][:2], {"role": "assistant", "content": "Hello, "}]
    ours = checkpoint.tokenizer.apply_chat_template(
        started, add_generation_prompt=False, continue_final_message=True
    )
    theirs = hf_tokenizer.apply_chat_template(
        started, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.endswith("assistant\nHello, ")


def test_tokenizer_cache_is_used_on_the_second_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gguf import GGUFReader

    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path))
    path = bundled_model_path()
    reader = GGUFReader(path)
    first = gguf_loader.load_gguf_tokenizer(path, reader)
    assert list((tmp_path / "tokenizers").iterdir())

    def must_not_build(*args: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(gguf_loader.Tokenizer, "from_gguf_spec", must_not_build)
    second = gguf_loader.load_gguf_tokenizer(path, reader)
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)
    assert second.eos_token_ids == first.eos_token_ids == (2,)
    assert second.chat_template == first.chat_template


def test_model_path_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a file"):
        resolve_model_path(tmp_path / "nope")
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        load_checkpoint(tmp_path / "model.bin")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_checkpoint(tmp_path)


def test_weights_cast_as_they_are_read(checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`load_checkpoint(dtype=...)` gives the weights a model built in that dtype would hold
    (so a bf16 model never needs all its weights in fp32), from a GGUF and an HF folder; and
    `load_config` reads the config without the weights."""
    save_safetensors_dir(checkpoint, tmp_path / "smol")
    for model in (None, tmp_path / "smol"):
        bf16 = load_checkpoint(model, dtype=torch.bfloat16)
        assert bf16.weights.keys() == checkpoint.weights.keys()
        for name, weight in checkpoint.weights.items():
            assert bf16.weights[name].dtype == torch.bfloat16, name
            assert torch.equal(bf16.weights[name], weight.to(torch.bfloat16)), name
        assert load_config(model) == checkpoint.config
