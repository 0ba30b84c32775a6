"""Drafters: the model-free ones and adaptive k (drafting ahead: test_drafting_ahead.py)."""

from __future__ import annotations

import random

import pytest

from workers.drafting.base import DraftRequest, DraftStateError
from workers.drafting.ngram import (
    LookupIndex,
    NgramConfig,
    NgramDrafter,
    SuffixDrafter,
    prompt_lookup,
)
from workers.engine.config import SpecConfig
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence, SpecStats, acceptance_curve
from workers.engine.speculator import Speculator
from workers.engine.step_costs import SPEC_STEP_OVERHEAD
from workers.kv_cache import BlockAllocator, BlockTable


@pytest.mark.parametrize("seed", range(4))
def test_the_lookup_index_finds_what_a_scan_finds(seed: int) -> None:
    """`LookupIndex` over a growing text (a few tokens a step, from a small vocabulary so that
    n-grams repeat) answers every lookup as `prompt_lookup`'s scan does."""
    rng = random.Random(seed)
    index = LookupIndex(1, 4)
    tokens: list[int] = []
    for _ in range(120):
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        for low, high in ((2, 4), (1, 1), (3, 3), (1, 4)):
            assert index.find(tokens, 5, low, high) == prompt_lookup(tokens, 5, low, high)
    with pytest.raises(ValueError, match="not all indexed"):
        LookupIndex(2, 4).find(tokens, 5, 1, 4)


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


def test_ngram_drafters_fall_back_to_the_last_token_with_a_short_draft() -> None:
    # [.., 9] is new as a pair (no 2..4-token suffix occurred before), but 9 alone did: the
    # fallback proposes what followed it, at most `fallback_tokens` of it.
    tokens = [1, 9, 2, 3, 4, 5, 6, 7, 8, 9]
    for drafter_type in (NgramDrafter, SuffixDrafter):
        drafter = drafter_type(NgramConfig(min_n=2, max_n=4, fallback_tokens=3))
        drafter.add("r", tokens, SamplingParams())
        assert drafter.propose([DraftRequest("r", 10, 8)])["r"].token_ids == [2, 3, 4]
        assert drafter.propose([DraftRequest("r", 10, 2)])["r"].token_ids == [2, 3]  # k rules
        # A real (two-token) match drafts its full k.
        drafter.commit("r", [2])
        assert drafter.propose([DraftRequest("r", 11, 6)])["r"].token_ids == [3, 4, 5, 6, 7, 8]
        off = drafter_type(NgramConfig(min_n=2, max_n=4, fallback_tokens=0))
        off.add("r", tokens, SamplingParams())
        assert off.propose([DraftRequest("r", 10, 8)])["r"].token_ids == []
    with pytest.raises(ValueError, match="fallback_tokens"):
        NgramConfig(fallback_tokens=-1)


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


def decoding(acceptance: float, method: str = "ngram", k_max: int = 8) -> Sequence:
    """A decoding sequence whose drafts so far were accepted at about this rate."""
    seq = Sequence(
        "r", [1, 2, 3], SamplingParams(max_tokens=100), method, k_max,
        BlockTable(BlockAllocator(4), 16), None, 0, token_ids=[1, 2, 3],
    )  # fmt: skip
    # 1000 steps of one draft each: the prior hardly matters.
    seq.stats.accepted = round(1000 * acceptance)
    seq.stats.verify_steps_with_rejection = 1000 - seq.stats.accepted
    seq.stats.verify_steps = 1000
    return seq


def chooser(costs: list[float], draft_cost: float = 0.0) -> Speculator:
    """`costs[n - 1]`: a forward over n new tokens."""
    return Speculator(
        SpecConfig(disable_batch_size=64),
        {},
        max_model_len=1000,
        verify_costs=tuple(costs),
        draft_costs={"draft_model": draft_cost},
    )


def test_acceptance_curve_is_geometric_at_one_rate_and_follows_each_position() -> None:
    # No steps yet: the prior's rate at every position.
    assert acceptance_curve(SpecStats(), 0.5, 3) == pytest.approx([0.5, 0.25, 0.125])
    # One rate everywhere (1000 one-token drafts, no positions recorded): geometric.
    assert acceptance_curve(decoding(0.6).stats, 0.5, 3) == pytest.approx(
        [0.6, 0.36, 0.216], abs=1e-3
    )
    # Copied text: half the drafts fail at their first token, the other half hold to the end.
    stats = SpecStats()
    for _ in range(50):
        stats.record(4, 0)
        stats.record(4, 4)
    assert stats.reached_per_position == [100, 50, 50, 50]
    reach = acceptance_curve(stats, 0.5, 8)
    assert reach[0] == pytest.approx(0.5, abs=0.01)
    assert reach[3] == pytest.approx(0.5, abs=0.03)  # once the first holds, the rest do
    assert reach[7] == pytest.approx(0.5, abs=0.03)  # past the measured positions: like the last


def test_copied_text_drafts_longer_than_one_overall_rate_would() -> None:
    cpu = chooser([1.0] + [1.25 + 0.01 * n for n in range(1, 17)])
    copied = decoding(0.0, k_max=16)
    copied.stats = SpecStats()
    for _ in range(50):
        copied.stats.record(4, 0)
        copied.stats.record(4, 4)
    same_rate = decoding(0.0, k_max=16)  # the same counts, without positions
    same_rate.stats.accepted, same_rate.stats.verify_steps_with_rejection = 200, 50
    same_rate.stats.verify_steps = 100
    geometric = cpu.num_draft_tokens([same_rate], 1)[0]
    assert 0 < geometric < 16
    assert cpu.num_draft_tokens([copied], 1) == [16]


def test_one_sequence_drafts_the_k_with_most_tokens_per_cost() -> None:
    cheap = chooser([1 + 0.05 * n for n in range(9)])
    assert cheap.num_draft_tokens([decoding(0.95)], 1) == [8]
    assert cheap.num_draft_tokens([decoding(0.02)], 1) == [0]
    assert 0 < cheap.num_draft_tokens([decoding(0.5)], 1)[0] < 8
    costly = chooser([1 + 0.5 * n for n in range(9)])
    assert costly.num_draft_tokens([decoding(0.6)], 1) < cheap.num_draft_tokens([decoding(0.6)], 1)
    # A draft model's tokens cost too.
    drafted = chooser([1 + 0.05 * n for n in range(9)], draft_cost=0.3)
    assert drafted.num_draft_tokens([decoding(0.6, "draft_model")], 1) < cheap.num_draft_tokens(
        [decoding(0.6)], 1
    )
    # A CPU in bf16: leaving the one-row path costs 25% at once, then tokens are nearly free.
    # Low acceptance must not draft at all; moderate acceptance drafts long.
    cpu = chooser([1.0] + [1.25 + 0.01 * n for n in range(1, 9)])
    assert cpu.num_draft_tokens([decoding(0.2)], 1) == [0]
    assert cpu.num_draft_tokens([decoding(0.6)], 1)[0] >= 4
    # Never past the request's own k or its max_tokens.
    assert cpu.num_draft_tokens([decoding(0.95, k_max=3)], 1) == [3]


def test_a_batch_drafts_less_as_its_forward_grows() -> None:
    # Flat up to 8 tokens, then every token costs an eighth more.
    costs = [1.0] * 8 + [n / 8 for n in range(9, 65)]
    spec = chooser(costs)
    alone = spec.num_draft_tokens([decoding(0.5)], 1)[0]
    four = spec.num_draft_tokens([decoding(0.5) for _ in range(4)], 4)
    assert sum(four) < 4 * alone
    # Low acceptance: worth a draft alone, not when it lengthens three others' forward too.
    assert spec.num_draft_tokens([decoding(0.3)], 1)[0] > 0
    assert spec.num_draft_tokens([decoding(0.3) for _ in range(8)], 8) == [0] * 8
    # A predictable sequence keeps drafting beside unpredictable ones.
    mixed = spec.num_draft_tokens([decoding(0.9), decoding(0.05), decoding(0.05)], 3)
    assert mixed[0] > 0 and mixed[1:] == [0, 0]
    # A seeded sampled request drafts as it would alone; the others share what is left.
    seeded = decoding(0.5)
    seeded.params = SamplingParams(max_tokens=100, temperature=0.8, seed=7)
    batch = spec.num_draft_tokens([seeded] + [decoding(0.5) for _ in range(3)], 4)
    assert batch[0] == alone and sum(batch[1:]) < sum(four[1:])
    # From disable_batch_size unfinished requests on, nobody drafts.
    small = Speculator(SpecConfig(disable_batch_size=4), {}, 1000, tuple(costs))
    assert small.num_draft_tokens([decoding(0.9)], 4) == [0]


def test_an_untried_method_is_measured_once_then_its_record_is_the_prior() -> None:
    """A draft model costing 0.45 target forwards a token does not pay at the prior's 1/2, so
    without a record nobody would ever draft with it: while no finished request has, a new one
    drafts its full k at its first step; after that, the method's pooled acceptance is the
    prior a new request starts from."""
    speculator = chooser([1 + 0.05 * n for n in range(9)], draft_cost=0.45)
    speculator.drafters["draft_model"] = NgramDrafter(NgramConfig())  # only told of removals
    assert speculator.num_draft_tokens([decoding(0.5, "draft_model")], 1) == [0]

    def new_request(seed: int | None = None) -> Sequence:
        seq = decoding(0.0, "draft_model")
        seq.stats = type(seq.stats)()  # no history
        if seed is not None:
            seq.params = SamplingParams(max_tokens=100, temperature=0.8, seed=seed)
        return seq

    first = new_request()
    assert speculator.num_draft_tokens([first], 1) == [8]  # measure the method
    # A seeded sampled request does not explore on the engine's behalf (its draws would then
    # depend on what was served before it): it judges by its own drafts under 1/2.
    assert speculator.num_draft_tokens([new_request(seed=3)], 1) == [0]
    first.stats.record(8, 8)
    speculator.remove(first)
    assert speculator.prior("draft_model") == pytest.approx(0.9)
    assert speculator.num_draft_tokens([new_request()], 1)[0] >= 2
    assert speculator.num_draft_tokens([new_request(seed=3)], 1) == [0]
    # A poor record: new requests start at k = 0 and only explore on the usual schedule.
    poor = chooser([1 + 0.05 * n for n in range(9)], draft_cost=0.45)
    poor.drafters["draft_model"] = NgramDrafter(NgramConfig())
    tried = new_request()
    tried.stats.record(8, 0)
    poor.remove(tried)
    assert poor.prior("draft_model") == pytest.approx(1 / 3)
    assert poor.num_draft_tokens([new_request()], 1) == [0]


def test_step_costs_charge_the_forward_drafting_and_overhead() -> None:
    costs = chooser([1.0, 1.2, 1.3], draft_cost=0.4).costs
    assert costs.forward_cost(1) == 1.0 and costs.forward_cost(3) == 1.3
    assert costs.forward_cost(6) == pytest.approx(2.6)  # beyond the table: in proportion
    assert costs.step_cost(["ngram"], [0]) == 1.0
    assert costs.step_cost(["ngram", "ngram"], [1, 0]) == pytest.approx(1.3 + SPEC_STEP_OVERHEAD)
    both = costs.step_cost(["draft_model", "ngram"], [2, 0])
    assert both == pytest.approx(costs.forward_cost(4) + 2 * 0.4 + SPEC_STEP_OVERHEAD)
    # Without a measured share of a further sequence, every draft token is priced alike.
    batch = costs.step_cost(["draft_model", "draft_model", "ngram"], [2, 3, 1])
    assert batch == pytest.approx(costs.forward_cost(9) + 5 * 0.4 + 3 * SPEC_STEP_OVERHEAD)
    # A model drafter drafts each depth for every sequence in one forward: with its measured
    # share of a further sequence (0.1), the batch pays its longest draft's depths in full and
    # the other draft tokens' shares.
    costs.draft_row_costs["draft_model"] = 0.1
    batch = costs.step_cost(["draft_model", "draft_model", "ngram"], [2, 3, 1])
    shares = 3 * 0.4 + 2 * 0.1
    assert batch == pytest.approx(costs.forward_cost(9) + shares + 3 * SPEC_STEP_OVERHEAD)


def test_a_draft_made_without_a_forward_is_priced_at_nothing() -> None:
    """A model drafter priced out of drafting (a head as costly as the target) still drafts
    where it would draft by prompt lookup: that draft costs no forward."""

    class LooksUp(NgramDrafter):
        method = "draft_model"

        def drafts_for_free(self, request_id: str) -> bool:
            return request_id == "free"

    spec = Speculator(
        SpecConfig(disable_batch_size=64),
        {"draft_model": LooksUp()},
        max_model_len=1000,
        verify_costs=(1.0,) * 16,
        draft_costs={"draft_model": 1.0},
    )
    priced, free = decoding(0.7, "draft_model", k_max=4), decoding(0.7, "draft_model", k_max=4)
    priced.request_id, free.request_id = "priced", "free"
    assert spec.num_draft_tokens([priced], 1) == [0]
    ks = spec.num_draft_tokens([priced, free], 2)
    assert ks[0] == 0 and ks[1] >= 2


def test_a_batch_drafts_as_far_as_one_sequence_where_the_forward_is_flat() -> None:
    """On a GPU a verify forward of up to 16 tokens costs what a one-token one does, and a
    model drafter's forward over four rows (measured) what one over a row does: four sequences
    that accept alike draft as far as one of them alone; priced per token per sequence, as
    before such a measure, they do not draft at all."""
    gpu = chooser([1.0] * 16, draft_cost=0.15)
    gpu.costs.draft_row_costs["draft_model"] = 0.0  # measured: a row more costs the forward nothing
    alone = gpu.num_draft_tokens([decoding(0.7, "draft_model", k_max=4)], 1)
    assert alone[0] >= 2
    batch = [decoding(0.7, "draft_model", k_max=4) for _ in range(4)]
    assert gpu.num_draft_tokens(batch, 4) == alone * 4
    del gpu.costs.draft_row_costs["draft_model"]
    assert gpu.num_draft_tokens(batch, 4) == [0] * 4


def test_a_drafters_launch_is_paid_once_a_step() -> None:
    """A draft loop costs a launch (staging, replay, read-back) and then little a depth: priced
    so, one sequence drafts its whole k; priced as if every depth paid the launch, less."""
    loop = chooser([1.0] * 16, draft_cost=0.05)
    loop.costs.draft_launch_costs["draft_model"] = 0.3
    both = loop.costs.step_cost(["draft_model", "draft_model"], [2, 3])
    assert both == pytest.approx(1.0 + 0.3 + 5 * 0.05 + 2 * SPEC_STEP_OVERHEAD)
    assert loop.costs.step_cost(["draft_model"], [0]) == 1.0  # no draft, no launch
    seq = [decoding(0.7, "draft_model", k_max=4)]
    per_depth = chooser([1.0] * 16, draft_cost=0.35)
    assert loop.num_draft_tokens(seq, 1) == [4]
    assert per_depth.num_draft_tokens(seq, 1)[0] < 4


def test_the_overhead_of_drafting_is_timed_as_served() -> None:
    """Drafting steps that take a whole forward more than priced (a GPU's host work beside a
    small model's forward): the measured overhead follows, and a sequence whose drafts pay at
    the default price stops drafting; plain steps keep the time of a forward's worth."""
    unit = 0.001
    spec = Speculator(
        SpecConfig(disable_batch_size=64),
        {},
        max_model_len=1000,
        verify_costs=(1.0,) * 16,
        unit_seconds=unit,
    )
    seq = decoding(0.5, "ngram", k_max=4)
    assert spec.num_draft_tokens([seq], 1) == [4]
    for _ in range(60):
        ks = spec.num_draft_tokens([seq], 1)
        priced = spec.costs.step_cost(["ngram"], ks) - (spec.costs.overhead if ks[0] else 0.0)
        spec.observe_step(1, unit * (priced + (1.0 if ks[0] else 0.0)))
    assert spec.costs.overhead == pytest.approx(1.0, abs=0.15)
    assert spec.num_draft_tokens([seq], 1) == [0]
    assert spec.costs.unit_seconds == pytest.approx(unit)
    spec.observe_step(2, 1.0)  # not the sequences this step's lengths were chosen for
    assert spec.costs.unit_seconds == pytest.approx(unit)


def test_a_prediction_is_drafted_from_its_start_and_followed_through_edits() -> None:
    from workers.drafting.ngram import Prediction

    prompt = [90, 91, 92]
    predicted = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7]
    prediction = Prediction(predicted, len(prompt))
    assert prediction.draft(prompt, 4, 2, 4) == [1, 2, 3, 4]  # nothing answered yet
    assert prediction.draft([*prompt, 1], 3, 2, 4) == [2, 3, 4]  # one token: matched alone
    # "1 2 3" occurs twice; the first at or after the last draft's place is taken.
    assert prediction.draft([*prompt, 1, 2, 3], 2, 2, 4) == [4, 5]
    assert prediction.draft([*prompt, 1, 2, 3, 4, 5, 1, 2, 3], 2, 2, 4) == [6, 7]
    # An edit (9 instead of 4 5) is passed over; the prediction is picked up where it resumes.
    fresh = Prediction(predicted, len(prompt))
    assert fresh.draft([*prompt, 1, 2, 3, 9, 9], 2, 2, 4) == []
    assert fresh.draft([*prompt, 1, 2, 3, 9, 9, 1, 2], 3, 2, 4) == [3, 4, 5]
    assert fresh.draft([*prompt, 7], 2, 2, 4) == []  # the prediction's end: nothing follows


def test_the_ngram_drafter_copies_a_prediction_first() -> None:
    drafter = NgramDrafter(NgramConfig(2, 4))
    params = SamplingParams(prediction=(5, 6, 7, 8))
    drafter.add("a", [1, 2, 1], params)
    drafter.add("b", [1, 2, 1], SamplingParams())
    drafts = drafter.propose([DraftRequest("a", 3, 3), DraftRequest("b", 3, 3)])
    assert drafts["a"].token_ids == [5, 6, 7] and drafts["b"].token_ids == [2, 1]
    drafter.commit("a", [5, 6])
    assert drafter.propose([DraftRequest("a", 5, 3)])["a"].token_ids == [7, 8]
