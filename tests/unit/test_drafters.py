"""Model-free drafters and adaptive k."""

from __future__ import annotations

import pytest

from workers.drafting.base import DraftRequest, DraftStateError
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter, prompt_lookup
from workers.engine.sampling_params import SamplingParams
from workers.engine.speculator import best_num_draft_tokens, expected_tokens


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
    assert best_num_draft_tokens(0.95, 8, 0.05) == 8
    assert best_num_draft_tokens(0.02, 8, 0.05) == 0
    assert 0 < best_num_draft_tokens(0.5, 8, 0.05) < 8
    assert best_num_draft_tokens(0.6, 8, 0.5) < best_num_draft_tokens(0.6, 8, 0.05)
