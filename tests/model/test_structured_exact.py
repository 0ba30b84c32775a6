"""Structured output on the bundled model (fp32): greedy decoding with speculation commits
exactly what plain decoding does under the same grammar, the text follows the grammar, and
sampling with drafts draws from the same distribution as sampling without them."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest

from router.tools import ToolCalling, call_grammar, read_answer, render_prompt
from tests.model.helpers import speculative_engine
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.engine.structured import compile_grammar

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\(555\) [0-9]{3}-[0-9]{4}"
COLOURS = ["red", "green", "blue", "dark purple"]
# The 99.99th percentile of chi-square by degrees of freedom: a correct sampler fails 1 in 10^4.
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


def chat(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_under_a_grammar_with_speculation_is_plain_decoding(  # type: ignore[no-untyped-def]
    method: str, model_fp32, checkpoint
) -> None:
    """A JSON schema, a regex, a choice, a free answer and a forced tool call in one batch;
    the n-gram drafter does not know the grammars, so its drafts are rejected wherever a
    grammar turns the target (and, for the tool call, copied from the prompt's example, they
    run past the grammar's end into EOS)."""
    tok = checkpoint.tokenizer
    eos = checkpoint.config.eos_token_ids
    weather = {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}}}
    asking = [{"role": "user", "content": "What is the weather like in Paris?"}]
    prompts = [
        chat(tok, "Alice is 30 and lives in Paris. Describe her as JSON."),
        chat(tok, "Give me a phone number."),
        chat(tok, "What colour is the sky?"),
        chat(tok, "Alice is 30 and lives in Paris. Describe her as JSON."),
        tok.encode(render_prompt(tok, asking, [{"type": "function", "function": weather}])),
    ]
    greedy = SamplingParams(max_tokens=48, temperature=0)
    params = [
        SamplingParams(max_tokens=48, temperature=0, structured=compile_grammar("json", PERSON)),
        SamplingParams(max_tokens=48, temperature=0, structured=compile_grammar("regex", PHONE)),
        SamplingParams(max_tokens=48, temperature=0, structured=compile_grammar("choice", COLOURS)),
        greedy,
        SamplingParams(
            max_tokens=48, temperature=0, structured=call_grammar([weather], "get_weather", False)
        ),
    ]
    plain = SequentialEngine(model_fp32, eos_token_ids=eos, max_model_len=512, tokenizer=tok)
    expected = [plain.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine = speculative_engine(method, model_fp32, eos, tokenizer=tok)
    got = engine.generate(prompts, params, RequestSpec(method=method))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    person, phone, colour, free, call = (g.text for g in got)
    jsonschema.validate(json.loads(person), PERSON)
    assert re.fullmatch(PHONE, phone) and colour in COLOURS
    assert read_answer(ToolCalling(("get_weather",), named=True), call)[0] is None
    assert [g.finish_reason for g in got] == ["stop"] * 3 + [got[3].finish_reason, "stop"]
    assert free != person  # the grammar changed the answer
    assert got[0].spec.accepted > 0  # masked rows after accepted drafts


def test_eagle_drafts_what_the_grammar_allows(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """With the grammar, every EAGLE draft (head or prompt lookup) is one the grammar takes
    whole, and more of them are accepted; without it (no tokenizer for the drafter), some
    drafts break the grammar. Output is the same either way."""
    tok = checkpoint.tokenizer
    eos = checkpoint.config.eos_token_ids
    prompts = [
        chat(tok, "Alice is 30 and lives in Paris. Describe her as JSON."),
        chat(tok, "Give me a phone number."),
    ]
    params = [
        SamplingParams(max_tokens=48, temperature=0, structured=compile_grammar("json", PERSON)),
        SamplingParams(max_tokens=48, temperature=0, structured=compile_grammar("regex", PHONE)),
    ]

    def run(engine):  # type: ignore[no-untyped-def]
        fits: list[bool] = []
        propose = engine.speculator.propose

        def checked(decoding, batch_size=None):  # type: ignore[no-untyped-def]
            seqs = list(decoding)
            propose(seqs, batch_size)
            for seq in seqs:
                draft = seq.draft.token_ids
                if draft:
                    fits.append(seq.grammar.valid_prefix(draft) == len(draft))

        engine.speculator.propose = checked
        return engine.generate(prompts, params, RequestSpec(method="eagle")), fits

    aware, aware_fits = run(speculative_engine("eagle", model_fp32, eos, tokenizer=tok))
    blind_engine = speculative_engine("eagle", model_fp32, eos, tokenizer=tok)
    blind_engine.speculator.drafters["eagle"].grammars = None  # type: ignore[attr-defined]
    blind, blind_fits = run(blind_engine)
    assert [c.token_ids for c in aware] == [c.token_ids for c in blind]
    assert aware_fits and all(aware_fits)
    assert not all(blind_fits)
    assert sum(c.spec.accepted for c in aware) > sum(c.spec.accepted for c in blind)


def test_structured_output_needs_a_tokenizer_and_a_valid_grammar(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from workers.engine.structured import StructuredOutput

    engine = speculative_engine("ngram", model_fp32, checkpoint.config.eos_token_ids)
    params = SamplingParams(structured=compile_grammar("regex", "[a-z]+"))
    with pytest.raises(ValueError, match="needs an engine with a tokenizer"):
        engine.add_request("a", [1, 2, 3], params)
    engine = speculative_engine(
        "ngram", model_fp32, checkpoint.config.eos_token_ids, tokenizer=checkpoint.tokenizer
    )
    with pytest.raises(ValueError, match="invalid grammar"):
        engine.add_request("a", [1, 2, 3], SamplingParams(structured=StructuredOutput("{}")))
    assert not engine.has_unfinished_requests()


def test_sampling_under_a_grammar_with_drafts_has_the_targets_distribution(  # type: ignore[no-untyped-def]
    model_fp32, checkpoint
) -> None:
    """Four words of three letters a or b at temperature 1, 500 times with n-gram drafts (the
    prompt repeats such words, so drafts come at every position and are often rejected) and
    500 times without: every answer fits the regex, and for each word after the first the two
    samples' counts of its 8 values agree by a chi-square test."""
    tok = checkpoint.tokenizer
    prompt = tok.encode(" ".join(["aab bab abb aba bba"] * 4))
    regex = " [ab]{3}( [ab]{3}){3}"
    structured = compile_grammar("regex", regex)
    # Fewer sequences than speculation's cutoff (64 in this engine), so every step drafts.
    engine = speculative_engine(
        "ngram",
        model_fp32,
        checkpoint.config.eos_token_ids,
        tokenizer=tok,
        max_num_seqs=48,
        max_num_batched_tokens=1024,
    )
    runs = 500

    def sample(spec: RequestSpec, seed0: int) -> list[list[str]]:
        params = [
            SamplingParams(max_tokens=24, temperature=1.0, seed=seed0 + i, structured=structured)
            for i in range(runs)
        ]
        out = engine.generate([prompt] * runs, params, spec)
        assert all(re.fullmatch(regex, o.text) for o in out)
        return [o.text.split() for o in out]

    with_drafts = sample(RequestSpec(method="ngram"), 0)
    stats = engine.stats
    # Drafts were accepted at every position, and rejected too.
    assert len(stats.accepted_per_position) == 4 and stats.accepted < stats.drafted / 2
    drafted = stats.drafted
    without = sample(RequestSpec(enabled=False), 10_000)
    assert engine.stats.drafted == drafted
    for word in (1, 2, 3):
        a = Counter(words[word] for words in with_drafts)
        b = Counter(words[word] for words in without)
        cells = [w for w in set(a) | set(b) if a[w] + b[w] >= 10]
        assert len(cells) >= 3
        # Two-sample chi-square over the cells with enough counts (equal sample sizes).
        chi2 = sum((a[w] - b[w]) ** 2 / (a[w] + b[w]) for w in cells)
        assert chi2 < CHI2_9999[min(len(cells) - 1, 7)], (word, a, b)
