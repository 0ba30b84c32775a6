"""Incremental detokenization with the real tokenizer: characters and stop strings stay whole."""

from __future__ import annotations

import pytest

from workers.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

TEXT = "Grüße aus Köln! 日本語のテキスト 🙂🙂 and plain ASCII, then END of story."


def feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in ids] + [detok.flush()]


def test_streamed_text_equals_the_whole_decode(checkpoint) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    ids = tok.encode(TEXT)
    deltas = feed_one_by_one(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    # Some emoji and CJK tokens are split mid-character: those steps emit nothing.
    assert "" in deltas[:-1]


def test_stop_string_across_token_boundaries(checkpoint) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, stop=("END of", "never"))
    deltas = []
    for t in ids:
        deltas.append(detok.add([t]))
        if detok.stopped:
            break
    assert detok.stopped
    assert "".join(deltas) + detok.flush() == TEXT[: TEXT.index("END of")]
    assert not any("END" in d for d in deltas)  # the held-back prefix was never sent


def test_text_that_only_starts_like_a_stop_string_is_released(checkpoint) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    ids = tok.encode("an ENDless road")
    detok = IncrementalDetokenizer(tok, stop=("END of",))
    assert "".join(feed_one_by_one(detok, ids)) == "an ENDless road"
    assert not detok.stopped


def test_engine_applies_stop_strings(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from workers.engine.config import EngineConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    tok = checkpoint.tokenizer
    engine = LLMEngine(
        model_fp32, EngineConfig(max_model_len=256), tokenizer=tok, eos_token_ids=(2,)
    )
    prompt = tok.encode("The capital of France is")
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert full.text.startswith(" Paris.")
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=(".",)))[
        0
    ]
    assert stopped.text == " Paris" and stopped.finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A stop string in the first `min_tokens` tokens is passed over; one after them ends
    the text."""
    tok = checkpoint.tokenizer
    text = "stop here, then go on and stop there."
    ids = tok.encode(text)
    early = len(tok.encode("stop here"))
    detok = IncrementalDetokenizer(tok, stop=("stop",), min_tokens=early + 1)
    out = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert detok.stopped
    assert out == text[: text.index("stop there")]
    plain = IncrementalDetokenizer(tok, stop=("stop",))
    assert "".join(plain.add([t]) for t in ids) + plain.flush() == ""


def test_the_stop_string_stays_on_request(checkpoint) -> None:  # type: ignore[no-untyped-def]
    """vLLM's include_stop_str_in_output: the text ends after the first stop string to appear
    (not the first in the list)."""
    tok = checkpoint.tokenizer
    text = "one two three four"
    detok = IncrementalDetokenizer(tok, stop=("four", "two"), include_stop=True)
    out = "".join(detok.add([t]) for t in tok.encode(text)) + detok.flush()
    assert detok.stopped and out == "one two"
