"""A step given up for an arrival (workers/engine/step_interrupt.py): the step commits
nothing, the arrival's prefill runs in the next step alone, and every text, greedy or seeded,
is that of an uninterrupted run; steps that cannot be given up so are not asked."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.factories import tiny_model
from tests.model.helpers import plain_tokens
from tests.unit.test_cuda import prompts
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.engine_loop import EngineLoop
from workers.engine.fair_share import Share
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

OFF = RequestSpec(enabled=False)


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=8, max_position_embeddings=512)


class AlwaysDrafts(Drafter):
    """Drafts k tokens for every sequence every step (most of them rejected)."""

    method = "ngram"

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: object) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        return {r.request_id: Draft([7] * r.k) for r in requests}


def engine(model: TransformerLM, drafts: bool = False, **config: object) -> LLMEngine:
    settings = EngineConfig(max_model_len=256, block_size=8, max_num_seqs=6, **config)  # type: ignore[arg-type]
    return LLMEngine(model, settings, drafters={"ngram": AlwaysDrafts()} if drafts else {})


def run(
    eng: LLMEngine, work: list[tuple[str, list[int], Share]], params: SamplingParams,
    give_up_at: int | None,
) -> dict[str, list[int]]:  # fmt: skip
    """The first request of `work` added at step `give_up_at` (the others at once), the step
    before it given up for it (None: all at once, nothing given up); each request's tokens."""
    arrivals = Arrivals()
    got: dict[str, list[int]] = {}
    late = work[-1] if give_up_at is not None else None
    for rid, prompt, share in work if late is None else work[:-1]:
        eng.add_request(rid, prompt, params, OFF, share=share)
    step = 0
    while eng.has_unfinished_requests() or late is not None:
        if late is not None and step == give_up_at:
            arrivals.pending = [late[2]]
            assert not [o for o in eng.step(arrivals) if o.new_token_ids]
            eng.add_request(late[0], late[1], params, OFF, share=late[2])
            arrivals.pending, late = [], None
        for out in eng.step(arrivals):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return got


class Arrivals:
    """What the engine loop tells a step (`Arrivals`): the shares of the requests that have
    come and are not taken in yet (`pending`); how often it was asked."""

    def __init__(self) -> None:
        self.pending: list[Share] = []
        self.asked = 0

    def __call__(self) -> list[Share]:
        self.asked += 1
        return list(self.pending)


@pytest.mark.parametrize("seed", [None, 11])
def test_a_step_given_up_for_an_arrival_leaves_every_text_whole(
    model: TransformerLM, seed: int | None
) -> None:
    params = (
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        if seed is None
        else SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
    )
    batch, late = prompts(3, seed=2), prompts(1, seed=3)[0]
    work = [(f"b{i}", p, Share("batch", priority=5)) for i, p in enumerate(batch)]
    work.append(("late", late, Share("chat")))
    eng = engine(model)
    got = run(eng, work, params, give_up_at=4)
    assert eng.scheduler.num_steps_given_up == 1
    # Each text is its own uninterrupted run's (a seeded draw depends on its position only).
    alone = {w[0]: run(engine(model), [w], params, None)[w[0]] for w in work}
    assert got == alone
    if seed is None:
        assert [got[rid] for rid, *_ in work] == plain_tokens(model, (), [*batch, late], params)


def test_the_arrival_gets_the_next_step_alone(model: TransformerLM) -> None:
    eng = engine(model)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=2)):
        eng.add_request(f"b{i}", p, params, OFF, share=Share("batch", priority=5))
    arrivals = Arrivals()
    for _ in range(4):
        eng.step(arrivals)
    # Not for more of the running tenant's, nor for a less urgent request: the fair share
    # would not admit those in a step of their own.
    for pending in (Share("batch", priority=5), Share("chat", priority=9)):
        arrivals.pending = [pending]
        assert [o for o in eng.step(arrivals) if o.new_token_ids]
    assert eng.scheduler.num_steps_given_up == 0
    arrivals.pending = [Share("chat", priority=5)]
    assert [o for o in eng.step(arrivals) if o.new_token_ids] == []
    eng.add_request("late", prompts(1, seed=3)[0], params, OFF, share=Share("chat", priority=5))
    arrivals.pending = []
    assert [o.request_id for o in eng.step(arrivals) if o.new_token_ids] == ["late"]


def test_a_step_with_a_prompt_in_it_is_given_up_whole(model: TransformerLM) -> None:
    """The step given up holds another prompt of the running tenant's (its K/V half written):
    that prompt runs again after the arrival's step, and its text is plain decoding's."""
    eng = engine(model)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch, newer, late = prompts(2, seed=2), prompts(1, seed=4)[0], prompts(1, seed=3)[0]
    got: dict[str, list[int]] = {}

    def step(arrivals: Arrivals | None = None) -> list[str]:
        outs = eng.step(arrivals)
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [out.request_id for out in outs if out.new_token_ids]

    for i, p in enumerate(batch):
        eng.add_request(f"b{i}", p, params, OFF, share=Share("batch"))
    for _ in range(3):
        step()
    eng.add_request("newer", newer, params, OFF, share=Share("batch"))
    arrivals = Arrivals()
    arrivals.pending = [Share("chat")]
    assert step(arrivals) == [] and eng.scheduler.num_steps_given_up == 1
    eng.add_request("late", late, params, OFF, share=Share("chat"))
    arrivals.pending = []
    assert step(arrivals) == ["late"]
    while eng.has_unfinished_requests():
        step(arrivals)
    want = plain_tokens(model, (), [*batch, newer, late], params)
    assert [got[r] for r in ("b0", "b1", "newer", "late")] == want


def test_the_shares_are_as_if_the_step_had_not_run(model: TransformerLM) -> None:
    eng = engine(model)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=2)):
        eng.add_request(f"b{i}", p, params, OFF, share=Share("batch"))
    for _ in range(3):
        eng.step()
    before = dict(eng.scheduler.fair.vtime)
    arrivals = Arrivals()
    arrivals.pending = [Share("chat")]
    eng.step(arrivals)
    assert eng.scheduler.num_steps_given_up == 1
    assert eng.scheduler.fair.vtime == pytest.approx(before)


@pytest.mark.parametrize("why", ["share cap off", "drafts"])
def test_steps_that_cannot_be_given_up_are_not_asked(model: TransformerLM, why: str) -> None:
    config: dict[str, object] = {"max_step_share": 1.0} if why == "share cap off" else {}
    if why == "drafts":  # a fixed k: every step verifies drafts
        config["spec"] = SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    eng = engine(model, drafts=why == "drafts", **config)
    spec = RequestSpec(method="ngram", num_speculative_tokens=3) if why == "drafts" else OFF
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(3, seed=2)):
        eng.add_request(f"b{i}", p, params, spec, share=Share("batch"))
    eng.step()
    arrivals = Arrivals()
    arrivals.pending = [Share("chat")]
    for _ in range(3):
        assert [o for o in eng.step(arrivals) if o.new_token_ids]
    assert arrivals.asked == 0 and eng.scheduler.num_steps_given_up == 0


def test_the_loop_tells_a_step_the_shares_of_submissions_not_taken_in_yet(
    model: TransformerLM,
) -> None:
    loop = EngineLoop(engine(model))
    try:
        assert loop._arrived() == []
        loop._arriving[1] = Share("batch")
        loop._arriving[2] = Share("chat", priority=9)
        assert loop._arrived() == [Share("batch"), Share("chat", priority=9)]
        loop._arriving.clear()
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        outputs = loop.submit("r", prompts(1, seed=3)[0], params, OFF, share=Share("chat"))
        next(outputs)  # taken in by the loop thread, which forgets its share then
        assert loop._arrived() == []
        list(outputs)
    finally:
        loop.close()
