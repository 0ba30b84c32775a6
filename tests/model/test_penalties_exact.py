"""Logit adjustments on the bundled model (fp32): plain decoding applies penalties as
transformers does (repetition) and as OpenAI defines them (frequency, presence), and greedy
decoding with speculation commits exactly what plain decoding does with the same penalties,
logit bias, `min_tokens`, bad words or allowed tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.model.helpers import speculative_engine
from tests.unit.test_penalties import reference
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 1, 2, 3, 1, 2, 3,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Once upon a time",
]
PENALIZED = SamplingParams(
    max_tokens=16,
    temperature=0,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    presence_penalty=0.2,
)


@pytest.fixture(scope="module")
def plain(model_fp32, checkpoint) -> SequentialEngine:  # type: ignore[no-untyped-def]
    return SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=512
    )


def test_repetition_penalty_matches_transformers_generate(plain, checkpoint, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt = checkpoint.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    ours = plain.generate(prompt, params).token_ids
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            min_new_tokens=16,
        )[0, len(prompt) :].tolist()
    assert ours == theirs
    unpenalized = plain.generate(prompt, SamplingParams(max_tokens=16, temperature=0)).token_ids
    assert ours != unpenalized  # the penalty changed the text


def test_all_penalties_match_a_loop_over_transformers_logits(plain, checkpoint, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt = checkpoint.tokenizer.encode(PROMPTS[1])
    ours = plain.generate(prompt, PENALIZED).token_ids
    tokens = list(prompt)
    eos = set(checkpoint.config.eos_token_ids)
    with torch.no_grad():
        while len(tokens) - len(prompt) < PENALIZED.max_tokens:
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].tolist()
            penalized = reference(logits, prompt, tokens[len(prompt) :], 1.2, 0.3, 0.2)
            tokens.append(max(range(len(penalized)), key=penalized.__getitem__))
            if tokens[-1] in eos:
                break
    assert ours == tokens[len(prompt) :]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_penalized_greedy_with_speculation_is_plain_decoding(  # type: ignore[no-untyped-def]
    method: str, plain, model_fp32, checkpoint
) -> None:
    """Four requests at once, half of them penalized (mildly: drafts still hold now and then);
    the drafters do not know the penalties, so their drafts are rejected where a penalty turns
    the target's choice."""
    engine = speculative_engine(method, model_fp32, checkpoint.config.eos_token_ids)
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    mild = replace(greedy, repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.05)
    params = [greedy, mild] * 2
    got = engine.generate(prompts, params, RequestSpec(method=method))
    assert got[1].spec.accepted > 0  # penalized rows after accepted drafts
    for prompt, p, result in zip(prompts, params, got, strict=True):
        assert result.token_ids == plain.generate(prompt, p).token_ids
    assert got[1].token_ids != plain.generate(prompts[1], greedy).token_ids


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_min_tokens_and_logit_bias_with_speculation_are_plain_decoding(  # type: ignore[no-untyped-def]
    method: str, plain, model_fp32, checkpoint
) -> None:
    """`min_tokens` holds EOS off past where the answer ended (the drafts propose it and are
    rejected); a bias of -100 on the answer's first token turns it away."""
    tok = checkpoint.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]))
    short = plain.generate(prompt, SamplingParams(max_tokens=48, temperature=0))
    assert short.finish_reason == "stop" and len(short.token_ids) < 32
    held = SamplingParams(max_tokens=48, temperature=0, min_tokens=len(short.token_ids) + 8)
    first = short.token_ids[0]
    biased = SamplingParams(max_tokens=12, temperature=0, logit_bias=((first, -100.0),))
    expected = [plain.generate(prompt, p).token_ids for p in (held, biased)]
    assert len(expected[0]) >= held.min_tokens
    assert expected[0][: len(short.token_ids) - 1] == short.token_ids[:-1]
    assert expected[1][0] != first
    engine = speculative_engine(method, model_fp32, checkpoint.config.eos_token_ids)
    got = engine.generate([prompt, prompt], [held, biased], RequestSpec(method=method))
    assert [g.token_ids for g in got] == expected
    assert got[0].spec.accepted > 0


def test_bad_words_and_allowed_tokens_with_speculation_are_plain_decoding(  # type: ignore[no-untyped-def]
    plain, model_fp32, checkpoint
) -> None:
    """The n-gram drafter copies the repeated pattern, bad word included; verification rules
    its last token out after the rest of it, so those drafts are rejected. Allowed tokens keep
    the answer inside their set the same way."""
    tok = checkpoint.tokenizer
    prompt = tok.encode(PROMPTS[1])
    unconstrained = plain.generate(prompt, SamplingParams(max_tokens=16, temperature=0))
    word = tuple(tok.encode(" 2, 3", add_special_tokens=False))
    banned = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=(word,))
    allowed = tuple(sorted({*tok.encode(" 1, 2, 4,", add_special_tokens=False)}))
    kept = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    expected = [plain.generate(prompt, p).token_ids for p in (banned, kept)]
    assert expected[0] != unconstrained.token_ids and set(expected[1]) <= set(allowed)
    engine = speculative_engine("ngram", model_fp32, checkpoint.config.eos_token_ids)
    got = engine.generate([prompt, prompt], [banned, kept], RequestSpec(method="ngram"))
    assert [g.token_ids for g in got] == expected
    assert got[0].spec.drafted > got[0].spec.accepted  # drafts of the bad word were turned away
    text = tok.decode(got[0].token_ids)
    assert "2, 3" not in text
