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


def test_an_engine_loops_callers_make_the_text_and_end_it_at_a_stop_string(  # type: ignore[no-untyped-def]
    model_fp32, checkpoint, monkeypatch
) -> None:
    """Through an `EngineLoop`, the text is made by its callers (a thread reading `submit`, an
    event loop reading `stream`), never on the loop's thread; it is the text, finish reason
    and token count the engine gives when it makes the text in its step. A stop string found
    there ends the request in the engine too: its blocks come back."""
    import asyncio
    import dataclasses
    import threading

    from workers.drafting.ngram import NgramConfig, NgramDrafter
    from workers.engine.config import EngineConfig, SpecConfig
    from workers.engine.engine_loop import EngineLoop
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.output_text import OutputText
    from workers.engine.sampling_params import SamplingParams

    tok = checkpoint.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "Count: one, two, three,")]
    # Left alone, the engine would go on for 400 tokens after a stop string.
    stopping = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    asked = [
        dataclasses.replace(stopping, stop=(".", ",")),
        dataclasses.replace(stopping, stop=(",", "never"), min_tokens=3),
        dataclasses.replace(stopping, stop=(" four", "."), include_stop_str_in_output=True),
        SamplingParams(max_tokens=6, temperature=0, stop=("never said",)),
    ]
    config = EngineConfig(max_model_len=256, spec=SpecConfig(method="ngram"))

    def engine() -> LLMEngine:
        drafters = {"ngram": NgramDrafter(NgramConfig(1, 3))}
        return LLMEngine(model_fp32, config, tokenizer=tok, eos_token_ids=(2,), drafters=drafters)

    cases = [(p, params) for p in prompts for params in asked]
    expected = engine().generate([p for p, _ in cases], [params for _, params in cases])
    assert [e.finish_reason for e in expected] == ["stop", "stop", "stop", "length"] * 2
    threads: set[str] = set()
    apply = OutputText.apply

    def recorded(self: OutputText, out: object) -> bool:
        threads.add(threading.current_thread().name)
        return apply(self, out)  # type: ignore[arg-type]

    monkeypatch.setattr(OutputText, "apply", recorded)
    loop = EngineLoop(engine())
    try:
        got = []
        for i, (p, params) in enumerate(cases):
            outs = list(loop.submit(f"sync-{i}", p, params))
            got.append(("".join(o.text for o in outs), outs[-1].finish_reason, outs[-1]))

        async def streamed(i: int, p: list[int], params: SamplingParams) -> list:  # type: ignore[type-arg]
            return [o async for o in loop.stream(f"async-{i}", p, params)]

        async def all_at_once() -> list:  # type: ignore[type-arg]
            return await asyncio.gather(*(streamed(i, *c) for i, c in enumerate(cases)))

        for outs in asyncio.run(all_at_once()):
            got.append(("".join(o.text for o in outs), outs[-1].finish_reason, outs[-1]))
        for _ in range(100):  # the aborts of requests their callers stopped reach the engine
            if not loop.engine.has_unfinished_requests():
                break
            threading.Event().wait(0.05)
        # A few steps past each stop string at most: nothing near 400 tokens a request.
        assert loop.engine.stats.verify_steps < 2 * sum(len(e.token_ids) for e in expected)
        allocator = loop.engine.allocator
        assert not loop.engine.has_unfinished_requests()
        assert allocator.num_free_blocks == allocator.num_blocks

        def failing(self: OutputText, out: object) -> bool:
            raise UnicodeError("no text")

        monkeypatch.setattr(OutputText, "apply", failing)  # a request whose text fails ends
        with pytest.raises(RuntimeError, match="its text failed"):
            asyncio.run(streamed(99, *cases[0]))
        for _ in range(100):
            if not loop.engine.has_unfinished_requests():
                break
            threading.Event().wait(0.05)
        assert allocator.num_free_blocks == allocator.num_blocks
    finally:
        loop.close()
    for (text, reason, last), want in zip(got, expected + expected, strict=True):
        assert (text, reason) == (want.text, want.finish_reason)
        assert last.num_output_tokens == len(want.token_ids)
    assert threads and "engine-loop" not in threads
