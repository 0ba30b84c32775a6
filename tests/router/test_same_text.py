"""Same request, same text, checked as a user checks it: the model as a CPU deployment serves it
(bf16 over the GGUF's blocks) with n-gram speculation and adaptive k, behind the router, through
the official `openai` client. One greedy chat request asked alone, asked again (its prompt now
in the prefix cache), streamed, and among seven others at once gives one text, the text of the
model decoding alone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.router.helpers import MODEL, start_router
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

QUESTION = "Explain in a few sentences why the sky looks blue during the day."
OTHERS = [
    "Write a haiku about autumn rain.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List three uses of a paper clip.",
    "Summarize: cats sleep a lot because they are predators that hunt in short bursts.",
    "Fix the bug: def add(a, b): return a - b",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def deployment(quantized_checkpoint, checkpoint, redis_server) -> Iterator[tuple[str, object]]:  # type: ignore[no-untyped-def]
    """(the router's URL, the model) for an engine built as `outrider serve` builds it on a
    CPU: bf16 activations over the GGUF's blocks, n-gram drafts, adaptive k."""
    from router.backends import LocalBackend
    from workers.drafting.ngram import NgramDrafter
    from workers.engine.config import EngineConfig, SpecConfig
    from workers.engine.engine_loop import EngineLoop
    from workers.engine.llm_engine import LLMEngine
    from workers.model.loader import build_model

    model = build_model(quantized_checkpoint, dtype=torch.bfloat16)
    engine = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=SpecConfig(method="ngram")),
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.config.eos_token_ids,
        drafters={"ngram": NgramDrafter()},
    )
    loop = EngineLoop(engine)
    running = start_router(
        LocalBackend(loop), checkpoint.tokenizer, redis_server, db=11, max_model_len=512
    )
    yield running.url, model
    running.stop()
    loop.close()


def test_one_request_gives_one_text_alone_again_streamed_and_among_others(
    deployment,
    checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    url, model = deployment
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")

    def ask(content: str) -> str:
        messages = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return reply.choices[0].message.content or ""

    tok = checkpoint.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    plain = SequentialEngine(model, eos_token_ids=checkpoint.config.eos_token_ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    alone = tok.decode(plain.generate(ids, params).token_ids)
    assert ask(QUESTION) == alone
    assert ask(QUESTION) == alone  # its prompt's blocks now come from the prefix cache
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(e.choices[0].delta.content or "" for e in stream if e.choices) == alone
    with ThreadPoolExecutor(len(OTHERS) + 1) as pool:
        answers = list(pool.map(ask, [*OTHERS[:4], QUESTION, *OTHERS[4:]]))
    assert answers[4] == alone
