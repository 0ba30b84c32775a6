"""Drafting ahead: a draft model's and a drafter actor's proposals prepared while the verifier
works, served when the guess was right and dropped when not."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from cluster.drafter_worker import DrafterRestarted, DrafterWorker, DraftReply, DraftStep
from cluster.links import TensorLink
from tests.factories import tiny_model
from tests.unit.helpers import draft_ends_where_its_probability_falls_below_the_bar
from workers.drafting.ahead import WHOLE_RATE_DECAY, AheadState
from workers.drafting.base import Draft, DraftRequest
from workers.drafting.draft_model import DraftModelDrafter
from workers.engine.config import SpecConfig
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM


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
