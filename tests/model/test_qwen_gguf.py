"""A real Qwen2 GGUF (K-quants, q/k/v biases, untied head, qwen2 pre-tokenizer) against
transformers. Runs where `make models-qwen` has fetched the model; skipped elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from router.protocol import RequestBuilder
from router.schemas import ChatCompletionRequest, validate
from router.tools import read_answer, render_prompt
from tests.model.helpers import WEATHER, all_logits
from workers.engine.sequential import SequentialEngine
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


def test_qwen_tool_calling_in_its_own_template_and_tag_tokens(qwen) -> None:  # type: ignore[no-untyped-def]
    """Qwen2.5's template renders tools, calls and results itself, as transformers renders them;
    its `<tool_call>` tags are tokens of their own, which a forced call's grammar asks for, and
    the answer's call is read back."""
    transformers = pytest.importorskip("transformers")
    checkpoint, path = qwen
    tok = checkpoint.tokenizer
    assert tok.takes_tools
    tools = [{"type": "function", "function": WEATHER}]
    call = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    conversation = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "user", "content": "And in Paris?"},
    ]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    as_objects = [dict(m) for m in conversation]
    as_objects[1]["tool_calls"] = [
        {"type": "function", "function": {**call, "arguments": {"city": "Rome"}}}
    ]
    assert render_prompt(tok, conversation, tools) == hf_tok.apply_chat_template(
        as_objects, tools=tools, tokenize=False, add_generation_prompt=True
    )

    body = {
        "messages": conversation,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "temperature": 0,
    }
    request = RequestBuilder(tok, NAME, 1024).chat(validate(ChatCompletionRequest, body))
    model = build_model(checkpoint, dtype=torch.bfloat16)
    engine = SequentialEngine(
        model, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=1024, tokenizer=tok
    )
    answer = engine.generate(request.prompt_ids, request.params)
    assert answer.token_ids[0] == tok.added_token_id("<tool_call>")
    assert request.tools is not None
    content, calls = read_answer(request.tools, tok.decode(answer.token_ids))
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
