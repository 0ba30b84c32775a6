"""Fair share inside the engine (workers/engine/fair_share.py): a tenant with a long queue does not
keep another's request waiting, shares follow weights, a step's places are capped per tenant
while others wait, and an urgent request preempts a less urgent one, whose text is then that of
an uninterrupted run."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.factories import tiny_model
from tests.model.helpers import plain_tokens
from tests.unit.test_cuda import prompts
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.fair_share import Share
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

OFF = RequestSpec(enabled=False)


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=6, max_position_embeddings=512)


def engine(model: TransformerLM, max_num_seqs: int = 4, **config: object) -> LLMEngine:
    settings = EngineConfig(max_model_len=256, block_size=8, max_num_seqs=max_num_seqs, **config)  # type: ignore[arg-type]
    return LLMEngine(model, settings)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_long_queue_does_not_hold_another_tenants_request(model: TransformerLM) -> None:
    """First come, first served, the victim's request would wait behind the flooder's twelve
    queued ones; fairly it is admitted at the first free place."""
    eng = engine(model)
    for i, p in enumerate(prompts(16, seed=2)):
        eng.add_request(f"f{i}", p, params(6), OFF, share=Share("flooder"))
    eng.step()  # the flooder's first four run
    eng.add_request("victim", prompts(1, seed=9)[0], params(6), OFF, share=Share("victim"))
    first_token_step = None
    for step in range(40):
        for out in eng.step():
            if out.request_id == "victim" and out.new_token_ids and first_token_step is None:
                first_token_step = step
    assert first_token_step is not None and first_token_step <= 8  # not after 12 x 6 tokens


def test_a_step_serves_at_most_its_share_of_one_tenant_while_another_waits(
    model: TransformerLM,
) -> None:
    eng = engine(model, max_num_seqs=8)
    for i, p in enumerate(prompts(8, seed=3)):
        eng.add_request(f"a{i}", p, params(30), OFF, share=Share("a"))
    for _ in range(3):
        eng.step()
    eng.add_request("b0", prompts(1, seed=4)[0], params(30), OFF, share=Share("b"))
    first = eng.scheduler.schedule()  # a yields a place at once: b needs no a to finish
    assert len(first.preempted) == 1 and first.preempted[0].share.tenant == "a"
    assert "b0" in {s.seq.request_id for s in first.seqs}
    for s in first.seqs:
        s.seq.num_computed_tokens += s.num_new_tokens
    served: Counter[str] = Counter()
    for _ in range(12):
        batch = eng.scheduler.schedule()
        tenants = Counter(s.seq.share.tenant for s in batch.seqs)
        assert tenants["a"] <= 4  # half of the step's eight places
        served.update(s.seq.request_id for s in batch.seqs if s.seq.share.tenant == "a")
        for s in batch.seqs:  # as if the step ran: computed, nothing new
            s.seq.num_computed_tokens += s.num_new_tokens
    assert len(served) == 7  # every one of a's running sequences had its turn


def test_an_arrivals_prefill_has_a_step_of_its_own_and_the_others_text_is_whole(
    model: TransformerLM,
) -> None:
    """The victim's prefill runs alone rather than beside the flooder's decoding rows, once:
    the step after it serves the flooder again; nobody's tokens change."""
    eng = engine(model, max_num_seqs=8)
    flood = prompts(4, seed=11)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    for i, p in enumerate(flood):
        eng.add_request(f"f{i}", p, params(12), OFF, share=Share("flooder"))
    for _ in range(3):
        step()
    victim = prompts(1, seed=12)[0]
    eng.add_request("victim", victim, params(12), OFF, share=Share("victim"))
    alone = eng.scheduler.schedule()
    assert [s.seq.request_id for s in alone.seqs] == ["victim"]
    for s in alone.seqs:  # as if the step ran
        s.seq.num_computed_tokens += s.num_new_tokens
    after = eng.scheduler.schedule()
    assert "flooder" in {s.seq.share.tenant for s in after.seqs}  # not two in a row
    eng = engine(model, max_num_seqs=8)  # the same again, stepped through
    got.clear()
    for i, p in enumerate(flood):
        eng.add_request(f"f{i}", p, params(12), OFF, share=Share("flooder"))
    for _ in range(3):
        step()
    eng.add_request("victim", victim, params(12), OFF, share=Share("victim"))
    while eng.has_unfinished_requests():
        step()
    want = plain_tokens(model, (), [*flood, victim], params(12))
    assert [got[f"f{i}"] for i in range(4)] + [got["victim"]] == want


@pytest.mark.parametrize(
    ("weights", "step_share", "low", "high"),
    [
        ((1.0, 1.0), 1.0, 0.45, 0.55),
        ((3.0, 1.0), 1.0, 0.7, 0.8),
        ((3.0, 1.0), 0.5, 0.7, 0.8),  # the cap on a step's share leaves the weights' shares
    ],
)
def test_two_saturating_tenants_share_by_weight(
    model: TransformerLM, weights: tuple[float, float], step_share: float, low: float, high: float
) -> None:
    eng = engine(model, max_num_seqs=8, max_step_share=step_share)
    prompt = prompts(1, seed=5)[0]  # alike, so that tokens given are tokens generated
    for i, p in enumerate([prompt] * 60):
        tenant = "a" if i % 2 else "b"
        weight = weights[0] if tenant == "a" else weights[1]
        eng.add_request(f"{tenant}{i}", p, params(8), OFF, share=Share(tenant, weight))
    tokens: Counter[str] = Counter()
    for _ in range(30):  # while both still have requests waiting
        for out in eng.step():
            tokens[out.request_id[0]] += len(out.new_token_ids)
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert low <= share <= high, share


@pytest.mark.parametrize("step_share", [1.0, 0.5])
def test_service_taken_while_the_other_tenant_was_idle_is_no_debt(
    model: TransformerLM, step_share: float
) -> None:
    """The served fairness run's order of things: `b` is served alone long after `a`'s last
    request, the engine empties, then `a` comes back first and `b` after it. Their shares from
    then on are the weights' (3:1), not `a` first until it has caught up with `b`'s past."""
    eng = engine(model, max_num_seqs=8, max_step_share=step_share)
    prompt = prompts(1, seed=5)[0]
    a, b = Share("a", 3.0), Share("b", 1.0)
    eng.add_request("a-before", prompt, params(4), OFF, share=a)
    for i in range(24):
        eng.add_request(f"b-before{i}", prompt, params(8), OFF, share=b)
    while eng.has_unfinished_requests():
        eng.step()
    for i in range(30):
        eng.add_request(f"a{i}", prompt, params(8), OFF, share=a)
    eng.step()  # `a` is running when `b` arrives
    for i in range(30):
        eng.add_request(f"b{i}", prompt, params(8), OFF, share=b)
    tokens: Counter[str] = Counter()
    for _ in range(30):  # while both still have requests waiting
        for out in eng.step():
            tokens[out.request_id[0]] += len(out.new_token_ids)
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert 0.7 <= share <= 0.8, share


def test_an_urgent_request_preempts_and_the_preempted_text_is_whole(model: TransformerLM) -> None:
    eng = engine(model, max_num_seqs=3)
    background = prompts(3, seed=6)
    for i, p in enumerate(background):
        eng.add_request(f"bg{i}", p, params(24), OFF, share=Share("batch", priority=10))
    got: dict[str, list[int]] = {}
    for _ in range(4):
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    urgent = prompts(1, seed=7)[0]
    eng.add_request("urgent", urgent, params(6), OFF, share=Share("ops", priority=0))
    urgent_done_at, step = None, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "urgent" and out.finish_reason and urgent_done_at is None:
                urgent_done_at = step
        step += 1
    assert eng.scheduler.num_preemptions >= 1
    assert urgent_done_at is not None and urgent_done_at <= 8  # ahead of the batch's 20 more
    want = plain_tokens(model, (), [*background, urgent], params(24))
    assert [got[f"bg{i}"] for i in range(3)] == want[:3]
    assert got["urgent"] == want[3][:6]


def test_bad_shares_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        Share("a", weight=0.0)
    with pytest.raises(ValueError, match="priority"):
        Share("a", priority=10_000)
    with pytest.raises(ValueError, match="max_step_share"):
        EngineConfig(max_step_share=0.0)
