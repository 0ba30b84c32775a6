"""Grammar states (workers/engine/structured.py) over the bundled tokenizer: each kind compiles
or is refused with a reason, masks agree with token-by-token consumption, draft rows match the
states the drafts lead to and leave the state as it was."""

from __future__ import annotations

import json
import logging
import math

import llguidance
import pytest
import torch

from workers.engine.structured import Grammars, GrammarState, StructuredOutput, compile_grammar
from workers.model.loader import load_tokenizer
from workers.model.tokenizer import Tokenizer

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB, tokenizer.eos_token_ids)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference_allowed(state: GrammarState, vocab: int) -> torch.Tensor:
    """Each token tried on its own: allowed if the grammar takes it (then rolled back)."""
    matcher = state._matcher
    allowed = torch.zeros(vocab, dtype=torch.bool)
    for token in range(vocab):
        if matcher.try_consume_tokens([token]) == 1:
            allowed[token] = True
            matcher.rollback(1)
    return allowed


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json", "{not json", "not valid JSON"),
        ("json", [1, 2], "must be an object"),
        ("json", {"type": "objectx"}, "invalid json"),
        ("regex", "", "non-empty string"),
        ("regex", "(ab", "invalid regex"),
        ("choice", [], "non-empty list"),
        ("choice", ["a", ""], "non-empty list"),
        ("grammar", "start: x", "unknown name"),
        ("grammar", "   ", "non-empty string"),
        ("xml", "<a/>", "unknown structured output kind"),
    ],
)
def test_bad_specifications_are_refused_with_a_reason(
    kind: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compile_grammar(kind, value)  # type: ignore[arg-type]


def test_each_kind_holds_the_text_to_its_specification(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    cases = [
        ("json", SCHEMA, '{"name": "Ann", "age": 30}', '{"name": "Ann"}'),
        ("json", json.dumps(SCHEMA), '{"name":"Ann","age":3}', '{"name": "Ann", "age": "3"}'),
        ("regex", r"[0-9]{3}-[0-9]{4}", "555-1234", "555-12a4"),
        ("choice", ['say "yes"', "no"], 'say "yes"', "maybe"),
        ("grammar", 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/', "(ab,c)", "(ab,)"),
    ]
    for kind, value, good, bad in cases:
        structured = compile_grammar(kind, value)  # type: ignore[arg-type]
        state = grammars.start(structured)
        tokens = ids(tokenizer, good)
        assert state.advance(tokens) == len(tokens), (kind, good)
        assert state.stopped or state._matcher.is_accepting(), (kind, good)
        # The whole bad text never fits: some token of it is refused, or it stops short.
        state = grammars.start(structured)
        bad_tokens = ids(tokenizer, bad)
        fits = state._matcher.validate_tokens(bad_tokens) == len(bad_tokens)
        assert not (fits and state._matcher.consume_tokens(bad_tokens) and state.stopped), bad


def test_json_whitespace_is_bounded_but_a_schema_may_widen_it(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """A run of blank lines (a small model's loop) is cut off; a schema's x-guidance options
    win (a null pattern: llguidance's own, any whitespace)."""
    bounded = grammars.start(compile_grammar("json", {"type": "array"}))._matcher
    loose = {"type": "array", "x-guidance": {"whitespace_pattern": None}}
    unbounded = grammars.start(compile_grammar("json", loose))._matcher
    tokens = ids(tokenizer, "[" + "\n" * 5)
    assert bounded.validate_tokens(tokens) < len(tokens)
    assert unbounded.validate_tokens(tokens) == len(tokens)
    indented = ids(tokenizer, "[\n    1,\n    2\n]")
    assert bounded.validate_tokens(indented) == len(indented)


@pytest.mark.slow
def test_masks_are_the_tokens_the_grammar_takes(grammars: Grammars, tokenizer: Tokenizer) -> None:
    state = grammars.start(compile_grammar("json", SCHEMA))
    state.advance(ids(tokenizer, '{"name": "A'))
    allowed = state.allowed()
    assert allowed.shape == (1, VOCAB)
    assert torch.equal(allowed[0], reference_allowed(state, VOCAB))
    assert 0 < int(allowed.sum()) < VOCAB


def test_draft_rows_are_the_states_the_drafts_lead_to(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    structured = compile_grammar("json", SCHEMA)
    prefix = ids(tokenizer, '{"name": "Bo')
    drafts = ids(tokenizer, 'b", "age": 4')
    state = grammars.start(structured)
    state.advance(prefix)
    before = state.allowed()
    rows = state.allowed(drafts)
    assert rows.shape == (len(drafts) + 1, VOCAB)
    assert torch.equal(state.allowed(), before)  # rolled back
    walker = grammars.start(structured)
    walker.advance(prefix)
    for j, token in enumerate(drafts):
        assert torch.equal(rows[j], walker.allowed()[0]), j
        assert bool(rows[j, token])
        walker.advance([token])
    assert torch.equal(rows[-1], walker.allowed()[0])


def test_drafts_past_the_grammars_end_leave_the_state_as_it_was(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Drafts that finish the grammar and go on with EOS (as n-gram drafts copied from a
    prompt do): llguidance reads the EOS after the end without recording it, so rolling back
    every valid draft took a committed token back."""
    state = grammars.start(compile_grammar("choice", ["ab cd"]))
    state.advance(ids(tokenizer, "ab"))
    before = state.allowed()
    eos = tokenizer.eos_token_ids[0]
    rows = state.allowed([*ids(tokenizer, " cd"), eos, eos])
    assert torch.equal(state.allowed(), before)
    assert rows[1:].nonzero()[:, 1].tolist() == [eos] * 3  # after the end: EOS only


def test_rows_after_a_refused_draft_repeat_the_row_before(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    state = grammars.start(compile_grammar("regex", r"[0-9]+"))
    digits = ids(tokenizer, "12")
    refused = ids(tokenizer, "x")
    drafts = [*digits, *refused, *digits]
    rows = state.allowed(drafts)
    n = len(digits)
    assert not bool(rows[n, refused[0]])
    for j in range(n + 1, len(drafts) + 1):
        assert torch.equal(rows[j], rows[n])
    assert state.advance(digits) == n  # the state did not move


def test_mask_rules_out_the_rest_and_the_grammar_wins_over_min_tokens(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    state = grammars.start(compile_grammar("choice", ["yes", "no"]))
    logits = torch.randn(1, VOCAB)
    masked = state.mask(logits.clone())
    allowed = state.allowed()[0]
    assert torch.equal(masked[0, allowed], logits[0, allowed])
    assert bool(torch.isinf(masked[0, ~allowed]).all())
    state.advance(ids(tokenizer, "yes"))
    assert state.stopped
    # Only EOS is left; `min_tokens` had put it at -inf: the row gets its allowed tokens at 0.
    eos = tokenizer.eos_token_ids[0]
    held = torch.randn(1, VOCAB)
    held[0, eos] = -math.inf
    out = state.mask(held)
    assert out[0, eos] == 0 and int(torch.isfinite(out).sum()) == 1


def test_advance_stops_at_the_grammars_end_and_at_a_refused_token(
    grammars: Grammars, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    structured = compile_grammar("choice", ["yes", "no"])
    yes = ids(tokenizer, "yes")
    eos = tokenizer.eos_token_ids[0]
    state = grammars.start(structured)
    assert state.advance([*yes, eos, eos]) == len(yes)  # stopped before the EOS
    state = grammars.start(structured)
    with caplog.at_level(logging.WARNING):
        assert state.advance(ids(tokenizer, "maybe")) == 0
    assert "refused" in caplog.text and state.stopped


def test_a_resumed_state_starts_past_its_committed_tokens(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    structured = compile_grammar("json", SCHEMA)
    committed = ids(tokenizer, '{"name": "Al')
    resumed = grammars.start(StructuredOutput(structured.grammar, tuple(committed)))
    walked = grammars.start(structured)
    walked.advance(committed)
    assert torch.equal(resumed.allowed(), walked.allowed())
    with pytest.raises(ValueError, match="do not follow"):
        grammars.start(StructuredOutput(structured.grammar, tuple(ids(tokenizer, "[1]"))))


def test_a_grammar_llguidance_refuses_at_start_is_a_value_error(grammars: Grammars) -> None:
    """What compile_grammar lets through but the matcher refuses (a hand-made grammar)."""
    with pytest.raises(ValueError, match="invalid grammar"):
        grammars.start(StructuredOutput(llguidance.LLMatcher.grammar_from_lark("start: x")))
