"""Drafters: the model-free ones, adaptive k, and drafting ahead with a draft model."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest

from cluster.drafter_worker import DrafterRestarted, DrafterWorker, DraftReply, DraftStep
from cluster.links import TensorLink
from tests.factories import tiny_model
from tests.unit.helpers import draft_ends_where_its_probability_falls_below_the_bar
from workers.drafting.ahead import WHOLE_RATE_DECAY, AheadState
from workers.drafting.base import Draft, DraftRequest, DraftStateError
from workers.drafting.draft_model import DraftModelDrafter
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
from workers.engine.speculator import SPEC_STEP_OVERHEAD, Speculator
from workers.kv_cache import BlockAllocator, BlockTable
from workers.model.transformer import TransformerLM


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
    spec = chooser([1.0, 1.2, 1.3], draft_cost=0.4)
    assert spec.forward_cost(1) == 1.0 and spec.forward_cost(3) == 1.3
    assert spec.forward_cost(6) == pytest.approx(2.6)  # beyond the table: in proportion
    assert spec.step_cost(["ngram"], [0]) == 1.0
    assert spec.step_cost(["ngram", "ngram"], [1, 0]) == pytest.approx(1.3 + SPEC_STEP_OVERHEAD)
    both = spec.step_cost(["draft_model", "ngram"], [2, 0])
    assert both == pytest.approx(spec.forward_cost(4) + 2 * 0.4 + SPEC_STEP_OVERHEAD)
    # Without a measured share of a further sequence, every draft token is priced alike.
    batch = spec.step_cost(["draft_model", "draft_model", "ngram"], [2, 3, 1])
    assert batch == pytest.approx(spec.forward_cost(9) + 5 * 0.4 + 3 * SPEC_STEP_OVERHEAD)
    # A model drafter drafts each depth for every sequence in one forward: with its measured
    # share of a further sequence (0.1), the batch pays its longest draft's depths in full and
    # the other draft tokens' shares.
    spec.draft_row_costs["draft_model"] = 0.1
    batch = spec.step_cost(["draft_model", "draft_model", "ngram"], [2, 3, 1])
    assert batch == pytest.approx(spec.forward_cost(9) + 3 * 0.4 + 2 * 0.1 + 3 * SPEC_STEP_OVERHEAD)


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
    gpu.draft_row_costs["draft_model"] = 0.0  # measured: a row more costs the forward nothing
    alone = gpu.num_draft_tokens([decoding(0.7, "draft_model", k_max=4)], 1)
    assert alone[0] >= 2
    batch = [decoding(0.7, "draft_model", k_max=4) for _ in range(4)]
    assert gpu.num_draft_tokens(batch, 4) == alone * 4
    del gpu.draft_row_costs["draft_model"]
    assert gpu.num_draft_tokens(batch, 4) == [0] * 4


def test_a_drafters_launch_is_paid_once_a_step() -> None:
    """A draft loop costs a launch (staging, replay, read-back) and then little a depth: priced
    so, one sequence drafts its whole k; priced as if every depth paid the launch, less."""
    loop = chooser([1.0] * 16, draft_cost=0.05)
    loop.draft_launch_costs["draft_model"] = 0.3
    both = loop.step_cost(["draft_model", "draft_model"], [2, 3])
    assert both == pytest.approx(1.0 + 0.3 + 5 * 0.05 + 2 * SPEC_STEP_OVERHEAD)
    assert loop.step_cost(["draft_model"], [0]) == 1.0  # no draft, no launch
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
        priced = spec.step_cost(["ngram"], ks) - (spec.overhead if ks[0] else 0.0)
        spec.observe_step(1, unit * (priced + (1.0 if ks[0] else 0.0)))
    assert spec.overhead == pytest.approx(1.0, abs=0.15)
    assert spec.num_draft_tokens([seq], 1) == [0]
    assert spec.unit_seconds == pytest.approx(unit)
    spec.observe_step(2, 1.0)  # not the sequences this step's lengths were chosen for
    assert spec.unit_seconds == pytest.approx(unit)


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
    # One rejection lowers the sequence's rate of whole acceptance; drafting ahead goes on.
    assert drafter._seqs["a"].ahead.whole_rate == pytest.approx(WHOLE_RATE_DECAY)
    drafter.draft_ahead(request)
    assert drafter.ahead_prepared == 3 and drafter._seqs["a"].ahead.guess is not None
    drafter.remove("a")
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks


def test_drafting_ahead_follows_the_rate_of_whole_acceptance() -> None:
    """A run of rejected drafts stops drafting ahead for a sequence (below MIN_WHOLE_RATE); a
    draft accepted whole brings it back; a step without a draft changes nothing."""
    state = AheadState()
    misses = 0
    while state.worth_it:
        state.draft = [1, 2, 3]
        state.committed([1, 9])
        misses += 1
    assert misses == 8  # 0.8 ** 8 < 0.2 <= 0.8 ** 7
    state.committed([4])  # no draft was made
    assert not state.worth_it
    state.draft = [1, 2, 3]
    state.committed([1, 2, 3, 4])  # accepted whole, with the bonus token
    assert state.worth_it and state.whole_rate == pytest.approx(0.8**9 + 0.2)


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


def test_abandoned_drafting_ahead_gives_its_forward_up_between_layers(
    draft_net: TransformerLM,
) -> None:
    """`abandon` is checked after every layer: drafting ahead stops inside the forward under
    way, prepares nothing, frees the slots it claimed, and the next proposal is exact."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 17, 33, 8]
    drafter = DraftModelDrafter(draft_net, num_blocks=32, block_size=2)
    drafter.add("a", prompt, greedy)
    request = [DraftRequest("a", 4, 3)]
    draft = drafter.propose(request)["a"].token_ids
    seq = drafter._seqs["a"]
    cached, free = list(seq.cached), drafter.allocator.num_free_blocks
    checks = itertools.count()
    drafter.draft_ahead(request, abandon=lambda: next(checks) >= 2)
    # Checked before the forward, after layer 0, and after layer 1, where it gave up.
    assert next(checks) == 3 and draft_net.config.num_layers == 2
    assert drafter.ahead_prepared == 0 and seq.ahead.guess is None
    assert seq.cached == cached and drafter.allocator.num_free_blocks == free
    drafter.commit("a", [draft[0], 0])
    fresh = DraftModelDrafter(draft_net, num_blocks=32, block_size=2)
    fresh.add("b", [*prompt, draft[0], 0], greedy)
    got = drafter.propose([DraftRequest("a", 6, 3)])["a"]
    assert got == fresh.propose([DraftRequest("b", 6, 3)])["b"]


def test_drafter_worker_abandons_drafting_ahead_only_when_no_commit_can_be_the_guess(
    draft_net: TransformerLM,
) -> None:
    """The guess is the whole draft accepted plus a bonus token: a commit that rejected any
    draft token (or carries no bonus token) cannot be it, and only the first commit of a
    sequence since the proposal counts."""
    worker = DrafterWorker(lambda: DraftModelDrafter(draft_net, num_blocks=32, block_size=4), "d")
    worker.drafter.add("a", [5, 17, 33, 8], SamplingParams(temperature=0.0))
    draft = worker.drafter.propose([DraftRequest("a", 4, 3)])["a"].token_ids
    other = (draft[1] + 1) % 97
    assert worker.guess_may_hold([("commit", "a", [*draft, 7])])
    assert not worker.guess_may_hold([("commit", "a", [draft[0], other])])
    assert not worker.guess_may_hold([("commit", "a", draft)])
    assert not worker.guess_may_hold([("commit", "a", [draft[0], other]), ("commit", "a", [1])])
    assert not worker.guess_may_hold([("remove", "a")]) and not worker.guess_may_hold([])
    assert not worker.guess_may_hold([("commit", "unknown", [*draft, 7])])


def test_a_new_link_drops_what_the_drafter_held_for_the_verifier_before(
    draft_net: TransformerLM,
) -> None:
    """A verifier that restarted (or reconnected) opens a new link and adds the sequences it
    holds afresh: steps meant for the old incarnation are refused, and the sequences of the
    old one go, their draft KV blocks with them."""
    greedy = SamplingParams(temperature=0.0)
    worker = DrafterWorker(
        lambda: DraftModelDrafter(draft_net, num_blocks=32, block_size=4), "d", draft_ahead=False
    )
    before = worker.incarnation
    adds = [("add", rid, [5, 17, 33, 8], greedy) for rid in ("a", "b")]
    worker.step(DraftStep(before, adds, [DraftRequest("a", 4, 3), DraftRequest("b", 4, 3)]))
    allocator = worker.drafter.allocator
    assert allocator.num_free_blocks < allocator.num_blocks
    host = TensorLink.host("drafter-relink", timeout_s=5.0)
    opened = threading.Thread(target=lambda: worker.open_link(host.address))
    opened.start()
    host.connect()
    opened.join()
    try:
        assert worker.incarnation > before
        with pytest.raises(DrafterRestarted):
            worker.step(DraftStep(before, [], [DraftRequest("a", 4, 3)]))
        reply = worker.step(DraftStep(worker.incarnation, adds[:1], [DraftRequest("a", 4, 3)]))
        assert len(reply.drafts["a"][0]) == 3
        assert set(worker.drafter._seqs) == {"a"}  # "b" went with the old incarnation
        worker.step(DraftStep(worker.incarnation, [("remove", "a")], []))
        assert allocator.num_free_blocks == allocator.num_blocks
    finally:
        assert worker.channel is not None
        worker.channel.close()


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


def test_a_draft_model_draft_ends_where_the_model_doubts_it(draft_net: TransformerLM) -> None:
    draft_ends_where_its_probability_falls_below_the_bar(
        lambda bar: DraftModelDrafter(draft_net, num_blocks=32, block_size=4, min_confidence=bar),
        [5, 17, 33, 8, 60],
        lambda drafter: None,
    )


def test_min_draft_confidence_is_checked() -> None:
    with pytest.raises(ValueError, match="min_draft_confidence"):
        SpecConfig(min_draft_confidence=1.0)


def _until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_drafting_ahead_that_goes_on_serves_right_guesses_without_stopping(
    draft_net: TransformerLM,
) -> None:
    """The drafter actor's side, driven as a verifier whose target is the draft model itself
    (every guess right) would drive it: after the first proposal, steps that only commit the
    guess are answered from the chain while its thread goes on; a rejection takes the usual
    path, and its proposal is what a fresh drafter proposes."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 17, 33, 8, 60, 2, 71]
    reference = DraftModelDrafter(draft_net, num_blocks=64, block_size=4)
    reference.add("r", prompt, greedy)
    whole = reference.propose([DraftRequest("r", 7, 24)])["r"].token_ids  # greedy continuation
    worker = DrafterWorker(lambda: DraftModelDrafter(draft_net, num_blocks=64, block_size=4), "d")
    assert worker.keep_going
    seq = lambda: worker.drafter._seqs["a"]  # noqa: E731

    def step(events: list, n: int) -> DraftReply:  # type: ignore[type-arg]
        return worker.step(DraftStep(worker.incarnation, events, [DraftRequest("a", n, 3)]))

    first = step([("add", "a", prompt, greedy)], 7)
    assert first.drafts["a"][0] == whole[:3] and not first.kept_going
    # The chain after the proposal: the guessed bonus token, k draft tokens, the next guess,
    # and the draft after that.
    _until(lambda: len(seq().ahead.chain) == 8)
    second = step([("commit", "a", whole[:4])], 11)
    assert second.kept_going and second.ahead_served == 1
    assert second.drafts["a"][0] == whole[4:7]
    assert seq().ahead.chain[:4] == whole[7:11]  # what is left goes on
    assert worker._ahead is not None and worker._ahead.is_alive()  # never stopped
    # The chain already holds the next whole draft: served at once.
    third = step([("commit", "a", whole[4:8])], 15)
    served = third.drafts["a"][0]
    assert third.kept_going and served == whole[8:11]
    # A rejection: stopped, committed, proposed as a fresh drafter would.
    wrong = [served[0], (whole[9] + 1) % 97] if len(served) > 1 else [(served[0] + 1) % 97]
    n = 15 + len(wrong)
    fourth = step([("commit", "a", wrong)], n)
    assert not fourth.kept_going and fourth.ahead_served == 0
    fresh = DraftModelDrafter(draft_net, num_blocks=64, block_size=4)
    fresh.add("b", prompt + whole[:8] + wrong, greedy)
    assert fourth.drafts["a"][0] == fresh.propose([DraftRequest("b", n, 3)])["b"].token_ids
    # A step that also removes a sequence takes the usual path; everything is freed.
    worker.step(DraftStep(worker.incarnation, [("remove", "a")], []))
    worker._finish_ahead(abandon=True)
    assert worker.drafter.allocator.num_free_blocks == worker.drafter.allocator.num_blocks


def test_drafting_ahead_that_stops_at_every_step_when_told_to(draft_net: TransformerLM) -> None:
    """`keep_drafting_ahead: false`: a step that only commits the guess stops the thread and
    is answered with the prepared draft, not from a chain that goes on; same tokens."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 17, 33, 8, 60, 2, 71]
    reference = DraftModelDrafter(draft_net, num_blocks=64, block_size=4)
    reference.add("r", prompt, greedy)
    whole = reference.propose([DraftRequest("r", 7, 24)])["r"].token_ids
    worker = DrafterWorker(
        lambda: DraftModelDrafter(draft_net, num_blocks=64, block_size=4), "d", keep_going=False
    )
    assert worker.draft_ahead and not worker.keep_going
    assert worker.info()["keep_drafting_ahead"] is False
    first = worker.step(
        DraftStep(worker.incarnation, [("add", "a", prompt, greedy)], [DraftRequest("a", 7, 3)])
    )
    assert first.drafts["a"][0] == whole[:3]
    assert worker._ahead is not None
    worker._ahead.join(timeout=30)  # without keep_going the thread ends at its prepared draft
    second = worker.step(
        DraftStep(worker.incarnation, [("commit", "a", whole[:4])], [DraftRequest("a", 11, 3)])
    )
    assert not second.kept_going and second.ahead_served == 1
    assert second.drafts["a"][0] == whole[4:7]
    worker.step(DraftStep(worker.incarnation, [("remove", "a")], []))
    worker._finish_ahead(abandon=True)
    assert worker.drafter.allocator.num_free_blocks == worker.drafter.allocator.num_blocks


def _keep_drafting_ahead(
    drafter: DraftModelDrafter, request: DraftRequest, stop: threading.Event
) -> threading.Thread:
    """Drafting ahead that goes on, on its own thread, until `stop` is set."""
    thread = threading.Thread(
        target=drafter.draft_ahead,
        args=([request], stop.is_set, lambda: False, True),
        daemon=True,
    )
    thread.start()
    return thread


def test_take_ahead_waits_for_the_whole_draft_an_in_line_proposal_would_make(
    draft_net: TransformerLM,
) -> None:
    """A step that commits the guess while the chain holds only part of the next draft waits
    for the rest (the draft is what `propose` would make, so acceptance per step stays the
    in-line engine's); past its timeout it takes what the chain holds; a wrong guess ends the
    wait at once."""
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 17, 33, 8, 60, 2, 71]
    reference = DraftModelDrafter(draft_net, num_blocks=64, block_size=4)
    reference.add("r", prompt, greedy)
    whole = reference.propose([DraftRequest("r", 7, 24)])["r"].token_ids
    drafter = DraftModelDrafter(draft_net, num_blocks=64, block_size=4)
    drafter.add("a", prompt, greedy)
    assert drafter.propose([DraftRequest("a", 7, 3)])["a"].token_ids == whole[:3]
    permits = threading.Semaphore(0)  # one per forward drafting ahead makes
    forward = drafter._forward

    def gated(*args, **kwargs):  # type: ignore[no-untyped-def]
        permits.acquire()
        return forward(*args, **kwargs)

    drafter._forward = gated  # type: ignore[method-assign]
    stop = threading.Event()
    ahead = _keep_drafting_ahead(drafter, DraftRequest("a", 7, 3), stop)
    seq = drafter._seqs["a"]
    permits.release(2)  # the guess and one draft token
    _until(lambda: len(seq.ahead.chain) == 2)
    taken: list[dict[str, Draft] | None] = []
    step = threading.Thread(
        target=lambda: taken.append(
            drafter.take_ahead({"a": whole[:4]}, [DraftRequest("a", 11, 3)], 30.0)
        )
    )
    step.start()
    step.join(timeout=0.3)
    assert step.is_alive() and len(seq.tokens) == 7  # waiting, nothing committed yet
    permits.release(2)  # the rest of the draft
    step.join(timeout=30)
    assert taken and taken[0] is not None and taken[0]["a"].token_ids == whole[4:7]
    # The next draft's guess and one token, then no more forwards: past the timeout the step
    # takes the one token.
    permits.release(2)
    _until(lambda: len(seq.ahead.chain) == 2)
    # A commit whose bonus token is not the guess is not waited for: nothing would be served.
    wrong = [*whole[4:7], (whole[7] + 1) % 97]
    start = time.monotonic()
    assert drafter.take_ahead({"a": wrong}, [DraftRequest("a", 15, 3)], 30.0) is None
    assert time.monotonic() - start < 5 and len(seq.tokens) == 11
    short = drafter.take_ahead({"a": whole[4:8]}, [DraftRequest("a", 15, 3)], 0.2)
    assert short is not None and short["a"].token_ids == whole[8:9]
    stop.set()
    permits.release(8)
    drafter.wake_ahead()
    ahead.join(timeout=10)
    assert not ahead.is_alive()


def test_take_ahead_changes_nothing_when_a_commit_is_not_the_guess(
    draft_net: TransformerLM,
) -> None:
    drafter = DraftModelDrafter(draft_net, num_blocks=32, block_size=4)
    drafter.add("a", [5, 17, 33, 8], SamplingParams(temperature=0.9, seed=3))
    request = [DraftRequest("a", 4, 2)]
    draft = drafter.propose(request)["a"]
    thread = threading.Thread(target=drafter.draft_ahead, args=(request,), daemon=True)
    thread.start()  # without keep_going: the chain stops at the guess and k draft tokens
    thread.join()
    # A finished chain is not followed any more: nothing to take from.
    assert drafter.take_ahead({"a": [*draft.token_ids, 1]}, [DraftRequest("a", 7, 2)], 0.1) is None
    stop = threading.Event()
    drafter.commit("a", [*draft.token_ids, 0])
    drafter.propose([DraftRequest("a", 7, 2)])
    ahead = _keep_drafting_ahead(drafter, DraftRequest("a", 7, 2), stop)
    seq = drafter._seqs["a"]
    _until(lambda: len(seq.ahead.chain) == 6)
    guess = seq.ahead.draft + seq.ahead.chain[:1]
    wrong = [*seq.ahead.draft, (seq.ahead.chain[0] + 1) % 97]
    assert drafter.take_ahead({"a": wrong}, [DraftRequest("a", 10, 2)], 0.1) is None
    assert drafter.take_ahead({"a": guess}, [DraftRequest("a", 9, 2)], 0.1) is None  # count
    assert len(seq.tokens) == 7 and len(seq.ahead.chain) == 6
    taken = drafter.take_ahead({"a": guess}, [DraftRequest("a", 10, 2)], 0.1)
    assert taken is not None and taken["a"].token_ids == seq.ahead.draft
    probs = taken["a"].probs  # sampled: q for each served token
    assert probs is not None and probs.shape == (2, 97)
    assert all(probs[i, t] > 0 for i, t in enumerate(taken["a"].token_ids))
    # Stopped, the chain becomes the usual guess and prepared draft.
    _until(lambda: len(seq.ahead.chain) == 6)
    chain = list(seq.ahead.chain)
    stop.set()
    drafter.wake_ahead()
    ahead.join(timeout=10)
    assert not ahead.is_alive() and not seq.ahead.following
    assert seq.ahead.guess == seq.ahead.draft + chain[:1]
    assert seq.ahead.prepared is not None and seq.ahead.prepared.token_ids == chain[1:3]


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
