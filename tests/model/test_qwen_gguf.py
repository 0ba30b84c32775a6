"""A real Qwen2 GGUF (K-quants, q/k/v biases, untied head, qwen2 pre-tokenizer) against
transformers. Runs where `make models-qwen` has fetched the model; skipped elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.model.helpers import all_logits
from workers.model.loader import build_model, load_checkpoint

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-0.5b"
TEXTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "x = 12345 + 678  # ünïcode",
]


@pytest.fixture(scope="module")
def qwen():  # type: ignore[no-untyped-def]
    # The test session points OUTRIDER_CACHE_DIR at a temporary folder; fetched models stay in
    # the user's cache, where `make models-qwen` put them.
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "outrider"
    path = user_cache / "models" / f"{NAME}.gguf"
    if not path.is_file():
        pytest.skip(f"{NAME} not fetched (make models-qwen)")
    return load_checkpoint(path), path


def test_qwen2_gguf_matches_transformers(qwen) -> None:  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    checkpoint, path = qwen
    config = checkpoint.config
    assert (
        config.architecture == "qwen2" and config.attention_bias and not config.tie_word_embeddings
    )
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert checkpoint.tokenizer.encode(text) == hf_tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert checkpoint.tokenizer.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = checkpoint.tokenizer.encode(TEXTS[0])
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor([ids])).logits[0]
    ours = all_logits(build_model(checkpoint), ids)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4
