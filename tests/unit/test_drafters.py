"""Drafters: the model-free ones, adaptive k, and drafting ahead with a draft model."""

from __future__ import annotations

import pytest

from tests.factories import tiny_model
from workers.drafting.base import DraftRequest, DraftStateError
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter, prompt_lookup
from workers.engine.config import SpecConfig
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculator import (
    SPEC_STEP_OVERHEAD,
    Speculator,
    best_num_draft_tokens,
    expected_tokens,
)
from workers.model.transformer import TransformerLM


def test_prompt_lookup_continues_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # Suffix [2, 3] last occurred at 6..7, followed by 7, 8, 5.
    assert prompt_lookup(tokens, 3, min_n=2, max_n=3) == [7, 8, 5]
    # With a 3-token suffix [5, 2, 3] there is no match; falls back to n = 2.
    assert prompt_lookup(tokens, 2, min_n=3, max_n=3) == []
    assert prompt_lookup([4, 4, 4, 4], 5, 1, 2) == [4]  # the draft stops at the sequence's end
    assert prompt_lookup([1, 2], 3, 2, 3) == []


def test_ngram_drafter_tracks_commits_and_checks_its_view() -> None:
    drafter = NgramDrafter(NgramConfig(min_n=1, max_n=2))
    drafter.add("r", [5, 6, 7, 5], SamplingParams())
    assert drafter.propose([DraftRequest("r", 4, 2)])["r"].token_ids == [6, 7]
    drafter.commit("r", [6])
    assert drafter.propose([DraftRequest("r", 5, 4)])["r"].token_ids == [7, 5, 6]
    with pytest.raises(DraftStateError):
        drafter.propose([DraftRequest("r", 9, 1)])
    drafter.remove("r")


def test_suffix_drafter_prefers_the_most_frequent_continuation_and_runs_on() -> None:
    tokens = [1, 2, 0, 1, 2, 0, 1, 3, 0, 1]
    # After context (1,): 2 followed twice, 3 once (most recently). Frequency wins.
    drafter = SuffixDrafter(NgramConfig(min_n=1, max_n=1))
    drafter.add("r", tokens, SamplingParams())
    draft = drafter.propose([DraftRequest("r", 10, 6)])["r"]
    assert draft.token_ids[:3] == [2, 0, 1]
    assert len(draft.token_ids) == 6  # keeps drafting from its own proposals
    assert draft.probs is None
    # The longer context (0, 1) is tried first: 2 and 3 followed it once each; the tie goes to
    # the one seen most recently.
    longer = SuffixDrafter(NgramConfig(min_n=1, max_n=2))
    longer.add("r", tokens, SamplingParams())
    assert longer.propose([DraftRequest("r", 10, 1)])["r"].token_ids == [3]


def test_expected_tokens_and_best_k() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    cheap = [1 + 0.05 * k for k in range(9)]
    assert best_num_draft_tokens(0.95, cheap) == 8
    assert best_num_draft_tokens(0.02, cheap) == 0
    assert 0 < best_num_draft_tokens(0.5, cheap) < 8
    costly = [1 + 0.5 * k for k in range(9)]
    assert best_num_draft_tokens(0.6, costly) < best_num_draft_tokens(0.6, cheap)
    # A CPU in bf16: leaving the one-row path costs 25% at once, then tokens are nearly free.
    # Low acceptance must not draft at all; moderate acceptance drafts long.
    cpu = [1.0] + [1.25 + 0.01 * k for k in range(1, 9)]
    assert best_num_draft_tokens(0.2, cpu) == 0
    assert best_num_draft_tokens(0.6, cpu) >= 4


def test_step_costs_charge_verification_drafting_and_overhead() -> None:
    spec = Speculator(
        SpecConfig(),
        {},
        max_model_len=100,
        verify_costs=(1.0, 1.2, 1.3),
        draft_costs={"draft_model": 0.4},
    )
    free = spec.step_costs("ngram", 4)
    assert free[0] == 1.0
    assert free[1:] == pytest.approx([c + SPEC_STEP_OVERHEAD for c in (1.2, 1.3, 1.3, 1.3)])
    model = spec.step_costs("draft_model", 2)
    assert model[2] == pytest.approx(1.3 + 2 * 0.4 + SPEC_STEP_OVERHEAD)


@pytest.fixture(scope="module")
def draft_net() -> TransformerLM:
    return tiny_model(seed=5)


def test_draft_model_drafting_ahead_serves_a_right_guess_and_drops_a_wrong_one(
    draft_net: TransformerLM,
) -> None:
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 17, 33, 8, 60, 2, 71]
    drafter = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    longer = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    for d in (drafter, longer):
        d.add("a", prompt, greedy)
    draft = drafter.propose([DraftRequest("a", 7, 3)])["a"].token_ids
    drafter.draft_ahead([DraftRequest("a", 7, 3)])
    # The guess (the draft plus the model's own next token) and the draft after it are what
    # one draft of 2k + 1 tokens holds.
    whole = longer.propose([DraftRequest("a", 7, 7)])["a"].token_ids
    assert draft == whole[:3]
    seq = drafter._seqs["a"]
    assert seq.ahead.guess == whole[:4] and seq.ahead.prepared is not None
    assert seq.ahead.prepared.token_ids == whole[4:]
    assert drafter.ahead_prepared == 1 and drafter.ahead_served == 0

    drafter.commit("a", whole[:4])  # the verifier accepted everything, bonus as guessed
    assert drafter.propose([DraftRequest("a", 11, 3)])["a"].token_ids == whole[4:]
    assert drafter.ahead_served == 1
    # Wrong guess next time: the prepared draft goes, the next proposal is a fresh one.
    drafter.draft_ahead([DraftRequest("a", 11, 3)])
    wrong = [whole[4], (whole[5] + 1) % 97]
    drafter.commit("a", wrong)
    fresh = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    fresh.add("b", prompt + whole[:5] + wrong[1:], greedy)
    request = [DraftRequest("a", 13, 3)]
    assert drafter.propose(request)["a"] == fresh.propose([DraftRequest("b", 13, 3)])["b"]
    assert drafter.ahead_served == 1
    # That draft followed a rejection: no drafting ahead until a draft is accepted whole.
    drafter.draft_ahead(request)
    assert drafter.ahead_prepared == 2 and drafter._seqs["a"].ahead.guess is None
    drafter.remove("a")
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks


def test_drafting_ahead_stops_when_asked(draft_net: TransformerLM) -> None:
    drafter = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    drafter.add("a", [5, 17, 33, 8], SamplingParams(temperature=0.0))
    request = [DraftRequest("a", 4, 3)]
    draft = drafter.propose(request)["a"].token_ids
    drafter.draft_ahead(request, stop=lambda: True)  # the next step is already here
    assert drafter.ahead_prepared == 0 and drafter._seqs["a"].ahead.guess is None
    # The cache still serves the next proposal correctly.
    drafter.commit("a", [draft[0], 0])
    fresh = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    fresh.add("b", [5, 17, 33, 8, draft[0], 0], SamplingParams(temperature=0.0))
    got = drafter.propose([DraftRequest("a", 6, 3)])["a"]
    assert got == fresh.propose([DraftRequest("b", 6, 3)])["b"]


def test_sampled_drafting_ahead_returns_q_for_each_prepared_token(
    draft_net: TransformerLM,
) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    drafter = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    drafter.add("a", [5, 17, 33, 8], params)
    draft = drafter.propose([DraftRequest("a", 4, 2)])["a"]
    drafter.draft_ahead([DraftRequest("a", 4, 2)])
    seq = drafter._seqs["a"]
    assert seq.ahead.guess is not None and seq.ahead.guess[:2] == draft.token_ids
    assert seq.ahead.prepared is not None and seq.ahead.prepared.probs is not None
    assert seq.ahead.prepared.probs.shape == (2, 97)
    assert all(
        seq.ahead.prepared.probs[i, t] > 0 for i, t in enumerate(seq.ahead.prepared.token_ids)
    )
