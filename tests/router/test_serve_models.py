"""`outrider serve --model DIR` with the architectures users bring (a Llama 3.1-shaped folder
with its rope scaling, a Qwen3 GGUF, a Mistral folder with a sliding window): each answers the
openai client with what our engine decodes from the same files in process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest

from tests.model_files import ARCH_CASES, VOCAB, model_weights, write_gguf, write_hf_folder
from tests.router.helpers import Served
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.loader import build_model, load_checkpoint

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def write_model(case: str, folder: Path) -> Path:
    """The case's model with the bundled tokenizer's vocabulary, as a folder or a GGUF file."""
    config = ARCH_CASES[case]
    config = dataclasses.replace(config, vocab_size=VOCAB)
    weights = model_weights(config, seed=7)
    if case == "qwen3":
        path = folder / "qwen3.gguf"
        write_gguf(config, weights, path, gguf.GGMLQuantizationType.Q8_0)
        return path
    return write_hf_folder(config, weights, folder / case)


@pytest.mark.parametrize("case", ["llama3.1", "qwen3", "mistral"])
def test_outrider_serve_answers_with_the_engines_tokens(case: str, tmp_path: Path) -> None:
    model = write_model(case, tmp_path)
    checkpoint = load_checkpoint(model)  # what `serve` loads: fp32 floats below
    engine = SequentialEngine(build_model(checkpoint), eos_token_ids=(), max_model_len=256)
    prompt = checkpoint.tokenizer.encode(checkpoint.tokenizer.apply_chat_template(MESSAGES))
    want = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    served = Served("--model", str(model), "--dtype", "float32", "--quantization", "none")
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    finally:
        served.stop()
    assert answer.choices[0].message.content == checkpoint.tokenizer.decode(want.token_ids)
    assert answer.usage is not None and answer.usage.completion_tokens == 12
