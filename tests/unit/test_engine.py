"""Engine mechanics on a tiny random model: each checked against plain decoding."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from tests.factories import tiny_model
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.transformer import TransformerLM

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=4, max_position_embeddings=512)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 90, (int(length),), generator=gen).tolist()
        for length in torch.randint(3, 40, (n,), generator=gen)
    ]


def reference(
    model: TransformerLM, prompt_ids: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    engine = SequentialEngine(model, max_model_len=512)
    return [engine.generate(p, params).token_ids for p in prompt_ids]


def engine(model: TransformerLM, **overrides: object) -> LLMEngine:
    spec = overrides.pop("spec", SpecConfig())
    config = EngineConfig(max_model_len=512, **{"spec": spec, **overrides})  # type: ignore[arg-type]
    return LLMEngine(model, config, drafters={"ngram": NgramDrafter(NgramConfig(1, 3))})


def run_to_end(eng: LLMEngine, tokens: dict[str, list[int]]) -> dict[str, RequestOutput]:
    """Step `eng` until no request is left, appending each request's new tokens to `tokens`;
    each request's last output (finish reason, error, counts)."""
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_batched_engine_matches_plain_decoding(model: TransformerLM) -> None:
    ps = prompts(6)
    results = engine(model).generate(ps, GREEDY)
    assert [r.token_ids for r in results] == reference(model, ps, GREEDY)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in results)


def test_chunked_prefill_gives_the_same_tokens(model: TransformerLM) -> None:
    ps = [list(range(5, 85)) * 2]  # 160 tokens, prefilled 32 at a time
    eng = engine(model, max_num_batched_tokens=32)
    assert eng.generate(ps, GREEDY)[0].token_ids == reference(model, ps, GREEDY)[0]


def test_preemption_under_kv_pressure_gives_the_same_tokens(model: TransformerLM) -> None:
    ps = prompts(5, seed=1)
    eng = engine(model, num_kv_blocks=9, block_size=8)  # far fewer blocks than 5 sequences want
    results = eng.generate(ps, GREEDY)
    assert [r.token_ids for r in results] == reference(model, ps, GREEDY)
    assert eng.allocator.num_free_blocks == 9


def test_prefix_cache_is_hit_and_changes_nothing(model: TransformerLM) -> None:
    prompt = list(range(10, 60))
    eng = engine(model, block_size=8)
    first = eng.generate([prompt], GREEDY)[0]
    cached = eng.allocator.num_cached_blocks
    assert cached >= 6
    eng.add_request("again", prompt, GREEDY)
    (out,) = eng.step()
    assert eng.scheduler.running[0].num_computed_tokens == len(prompt)  # 48 cached + 2 computed
    assert out.num_cached_tokens == 48 and first.finish_reason == "length"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.generate([prompt], GREEDY)[0].token_ids == first.token_ids


def test_abort_frees_blocks_and_reports(model: TransformerLM) -> None:
    eng = engine(model)
    eng.add_request("a", list(range(3, 40)), GREEDY)
    eng.add_request("b", list(range(3, 20)), GREEDY)
    eng.step()
    eng.abort_request("a")
    outputs = {o.request_id: o for o in eng.step()}
    assert outputs["a"].finished and outputs["a"].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.allocator.num_free_blocks == eng.config.kv_blocks


class _Exploding:
    """A grammar state that raises where `where` says: a stand-in for a bug in one request's
    own work (its masks in verification, or reading the tokens it commits)."""

    stopped = False

    def __init__(self, where: str) -> None:
        self.where = where

    def mask(self, logits: torch.Tensor, draft_ids: Sequence[int] = ()) -> torch.Tensor:
        if self.where == "mask":
            logits.fill_(float("nan"))  # half-done work left behind
            raise RuntimeError("boom in mask")
        return logits

    def advance(self, tokens: Sequence[int]) -> int:
        if self.where == "advance":
            raise RuntimeError("boom in advance")
        return len(tokens)


@pytest.mark.parametrize("where", ["mask", "advance"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_whose_own_work_fails_ends_alone(
    model: TransformerLM, where: str, temperature: float
) -> None:
    """The failing request finishes with "error" and its message, its blocks come back, and
    the requests batched with it commit what they would have without it (greedy, or seeded)."""
    ps = prompts(3, seed=2)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=1, ignore_eos=True)
    expected = engine(model).generate([ps[0], ps[2]], params)
    eng = engine(model)
    # A zero logit bias changes nothing but sends the request's rows through `adjust`.
    poisoned = dataclasses.replace(params, logit_bias=((5, 0.0),))
    for i, (prompt, p) in enumerate(zip(ps, [params, poisoned, params], strict=True)):
        eng.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {"r0": [], "r1": [], "r2": []}
    for out in eng.step():  # the prompts and their first tokens
        tokens[out.request_id] += out.new_token_ids
    eng._seqs["r1"].grammar = _Exploding(where)  # type: ignore[assignment]
    finals = run_to_end(eng, tokens)
    assert finals["r1"].finish_reason == "error"
    assert finals["r1"].error == f"RuntimeError: boom in {where}"
    assert [tokens["r0"], tokens["r2"]] == [e.token_ids for e in expected]
    assert eng.allocator.num_free_blocks == eng.config.kv_blocks
    eng.add_request("again", ps[1], poisoned)
    eng._seqs["again"].grammar = _Exploding(where)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match=f"failed: RuntimeError: boom in {where}"):
        eng.generate([ps[0]], params)


def test_bad_requests_are_rejected(model: TransformerLM) -> None:
    eng = engine(model)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="context holds"):
        eng.add_request("x", [5] * 600, GREEDY)
    with pytest.raises(ValueError, match="not available"):
        eng.add_request("x", [5, 6], GREEDY, RequestSpec(method="draft_model"))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request("x", [5, 6], dataclasses.replace(GREEDY, stop=("a",)))
    eng.add_request("x", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already exists"):
        eng.add_request("x", [5, 6], GREEDY)


class OracleDrafter(Drafter):
    """Drafts what plain decoding will produce, except that a draft of k > 2 tokens gets its
    last token wrong: acceptance, rejection and bonus tokens all happen, deterministically."""

    method = "ngram"

    def __init__(self, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.futures = futures
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.prompts[request_id] = tuple(prompt_token_ids)
        self.tokens[request_id] = list(prompt_token_ids)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.tokens[request_id] += token_ids

    def remove(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for req in requests:
            prompt = self.prompts[req.request_id]
            done = len(self.tokens[req.request_id]) - len(prompt)
            right = self.futures[prompt][done : done + req.k]
            if req.k > 2 and len(right) == req.k:
                right[-1] = (right[-1] + 1) % 90
            drafts[req.request_id] = Draft(right)
        return drafts


def test_accept_reject_and_bonus_keep_output_and_stop_exactly(model: TransformerLM) -> None:
    ps = prompts(4, seed=3)
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    expected = reference(model, ps, params)
    futures = {tuple(p): e + [0] * 20 for p, e in zip(ps, expected, strict=True)}
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=4, adaptive=False, disable_batch_size=64
    )
    eng = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=spec),
        drafters={"ngram": OracleDrafter(futures)},
    )
    results = eng.generate(ps, params)
    assert [r.token_ids for r in results] == expected  # max_tokens hit mid-draft: cut exactly
    stats = results[0].spec
    assert stats.accepted > 0 and stats.verify_steps_with_rejection > 0
    assert stats.mean_acceptance_length > 2


def test_eos_inside_accepted_drafts_ends_the_output_there(model: TransformerLM) -> None:
    ps = prompts(1, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = reference(model, ps, params)[0]
    eos = expected[5]  # pretend the 6th generated token is EOS
    futures = {tuple(ps[0]): expected + [0] * 20}
    spec = SpecConfig(method="ngram", num_speculative_tokens=8, adaptive=False)
    eng = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=spec),
        eos_token_ids=(eos,),
        drafters={"ngram": OracleDrafter(futures)},
    )
    result = eng.generate(ps, dataclasses.replace(params, ignore_eos=False))[0]
    assert result.token_ids == expected[: expected.index(eos) + 1]
    assert result.finish_reason == "stop"


def test_drafts_never_run_past_the_context(model: TransformerLM) -> None:
    prompt = [(7 * i) % 80 + 3 for i in range(500)]  # 12 tokens short of the 512-token context
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    futures = {tuple(prompt): reference(model, [prompt], params)[0] + [0] * 20}
    spec = SpecConfig(method="ngram", num_speculative_tokens=8, adaptive=False)
    eng = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=spec),
        drafters={"ngram": OracleDrafter(futures)},
    )
    result = eng.generate([prompt], params)[0]
    assert result.finish_reason == "length" and len(prompt) + len(result.token_ids) == 512
    assert result.token_ids == futures[tuple(prompt)][: len(result.token_ids)]


class FlakyDrafter(OracleDrafter):
    """The oracle, but its work for request `victim` goes wrong at the `when`-th commit:
    `where` is the call that raises, or "vocab" for a draft with an id past the vocabulary."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]], where: str) -> None:
        super().__init__(futures)
        self.where, self.victim, self.commits = where, "r1", 0
        self.removed: list[str] = []

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if self.where == "add" and request_id == self.victim:
            raise RuntimeError("boom in add")
        super().add(request_id, prompt_token_ids, params)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        if request_id == self.victim:
            self.commits += 1
            if self.where == "commit" and self.commits == 3:
                raise RuntimeError("boom in commit")
        super().commit(request_id, token_ids)

    def remove(self, request_id: str) -> None:
        self.removed.append(request_id)
        super().remove(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        wrong = self.commits >= 3 and any(r.request_id == self.victim for r in requests)
        if self.where == "propose" and wrong:
            raise RuntimeError("boom in propose")
        drafts = super().propose(requests)
        if self.where == "vocab" and wrong:
            drafts[self.victim] = Draft([10**6] * len(drafts[self.victim].token_ids))
        return drafts


@pytest.mark.parametrize("where", ["add", "commit", "propose", "vocab"])
def test_a_failing_drafter_only_stops_speculation(model: TransformerLM, where: str) -> None:
    """Drafts are proposals: a drafter that raises, or drafts a token the model does not have,
    fails no request. The sequences of the failed call decode on without drafts (their drafter
    forgets them); the others keep speculating; every output is plain decoding's."""
    ps = prompts(3, seed=11)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = reference(model, ps, params)
    futures = {tuple(p): e + [0] * 20 for p, e in zip(ps, expected, strict=True)}
    spec = SpecConfig(method="ngram", num_speculative_tokens=2, adaptive=False)
    drafter = FlakyDrafter(futures, where)
    eng = LLMEngine(model, EngineConfig(max_model_len=512, spec=spec), drafters={"ngram": drafter})
    ids = [f"r{i}" for i in range(len(ps))]
    for rid, prompt in zip(ids, ps, strict=True):
        eng.add_request(rid, prompt, params)
    seqs = [eng._seqs[rid] for rid in ids]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.error is None and out.finish_reason in (None, "length")
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[rid] for rid in ids] == expected
    assert eng.speculator.failures == {"ngram": 1}
    # The victim stopped drafting at the failure; it had drafted before unless it failed at once.
    victim = seqs[1]
    assert victim.spec_method == "none" and "r1" in drafter.removed
    steps_without_drafts = len(expected[1]) - 1  # the prefill committed the first token
    if where == "add":
        assert victim.stats.drafted == 0 and victim.stats.verify_steps == steps_without_drafts
    else:
        assert victim.stats.accepted > 0 and victim.stats.verify_steps < steps_without_drafts
    if where != "propose":  # a failed propose was for the whole batch; else only the victim's
        assert [seqs[0].spec_method, seqs[2].spec_method] == ["ngram", "ngram"]
        assert all(seq.stats.mean_acceptance_length > 1.5 for seq in (seqs[0], seqs[2]))


def test_calibrated_verify_costs_have_the_right_shape(model: TransformerLM) -> None:
    from workers.engine.calibration import verify_costs

    costs = verify_costs(model, max_tokens=11, reps=1)
    assert len(costs) == 11 and costs[0] == 1.0
    assert all(c >= 1.0 for c in costs)
    # Measured at 1, 2, 4, 8 and 11 tokens, linear in between.
    for lo, hi in ((2, 4), (4, 8), (8, 11)):
        low, high = sorted((costs[lo - 1], costs[hi - 1]))
        assert all(low - 1e-9 <= c <= high + 1e-9 for c in costs[lo:hi])
    spec = SpecConfig(method="ngram", num_speculative_tokens=6)
    eng = LLMEngine(
        model, EngineConfig(max_model_len=512, spec=spec), drafters={"ngram": NgramDrafter()}
    )
    # Measured at start-up, up to the largest speculating batch: 7 sequences of 1 + 6 tokens.
    assert len(eng.speculator.costs.verify_costs) == 7 * 7
    fixed = SpecConfig(method="ngram", verify_costs=(1.0, 1.1))
    eng = LLMEngine(
        model, EngineConfig(max_model_len=512, spec=fixed), drafters={"ngram": NgramDrafter()}
    )
    assert eng.speculator.costs.verify_costs == (1.0, 1.1)


def test_waiting_requests_count_toward_the_speculation_cutoff(model: TransformerLM) -> None:
    """One sequence decodes while three more wait: with disable_batch_size 3 nobody drafts until
    the queue has drained below the cutoff; then drafting starts, and the output is the same."""
    ps = prompts(4, seed=7)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = reference(model, ps, params)
    futures = {tuple(p): e + [0] * 20 for p, e in zip(ps, expected, strict=True)}
    spec = SpecConfig(
        method="ngram", num_speculative_tokens=2, adaptive=False, disable_batch_size=3
    )
    eng = LLMEngine(
        model,
        EngineConfig(max_model_len=512, max_num_seqs=1, spec=spec),  # one runs, three wait
        drafters={"ngram": OracleDrafter(futures)},
    )
    drafted_while_queued = []
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    while eng.has_unfinished_requests():
        before = eng.stats.drafted
        queued = eng.scheduler.num_unfinished
        for out in eng.step():
            outputs[out.request_id] += out.new_token_ids
        drafted_while_queued.append((queued, eng.stats.drafted - before))
    assert [outputs[f"r{i}"] for i in range(len(ps))] == expected
    assert all(drafted == 0 for queued, drafted in drafted_while_queued if queued >= 3)
    assert any(drafted > 0 for queued, drafted in drafted_while_queued if queued < 3)


def test_a_finished_request_counts_the_predicted_tokens_its_output_holds(
    model: TransformerLM,
) -> None:
    """OpenAI's accepted_prediction_tokens: the prediction's tokens the output holds in order
    (one changed token is the one not counted); the output is plain decoding's either way."""
    ps = prompts(2, seed=13)
    expected = reference(model, ps, GREEDY)
    edited = list(expected[1])
    edited[4] = (edited[4] + 1) % 90
    eng = engine(model, spec=SpecConfig(method="ngram", adaptive=False))
    for rid, prompt, predicted in (("right", ps[0], expected[0]), ("edited", ps[1], edited)):
        eng.add_request(rid, prompt, dataclasses.replace(GREEDY, prediction=tuple(predicted)))
    eng.add_request("none", ps[0], GREEDY)
    tokens: dict[str, list[int]] = {"right": [], "edited": [], "none": []}
    finals = run_to_end(eng, tokens)
    assert [tokens["right"], tokens["edited"], tokens["none"]] == [*expected, expected[0]]
    counted = {rid: out.accepted_prediction_tokens for rid, out in finals.items()}
    assert counted == {"right": 12, "edited": 11, "none": 0}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_answer_ends_where_its_settings_leave_no_token(
    model: TransformerLM, temperature: float
) -> None:
    """Only token 7 is allowed and the bad word 7 7 7 rules it out after two 7s: nothing may
    come third, so the answer ends there (finish reason "stop"), as plain decoding's does,
    whether or not drafts (7s, from its prediction) run through that position. No token its
    settings rule out is ever committed, and the request beside it is plain decoding's."""
    ps = prompts(2, seed=17)
    base = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    stuck = dataclasses.replace(
        base, allowed_token_ids=(7,), bad_words=((7, 7, 7),), prediction=(7,) * 12
    )
    plain = SequentialEngine(model, max_model_len=512).generate(ps[0], stuck)
    assert (plain.token_ids, plain.finish_reason) == ([7, 7], "stop")
    (expected,) = reference(model, [ps[1]], GREEDY)
    for spec in (SpecConfig(), SpecConfig(method="ngram", adaptive=False)):
        eng = engine(model, spec=spec)
        eng.add_request("stuck", ps[0], stuck)
        eng.add_request("other", ps[1], GREEDY, RequestSpec(method="none"))
        tokens: dict[str, list[int]] = {"stuck": [], "other": []}
        finals = run_to_end(eng, tokens)
        assert tokens == {"stuck": [7, 7], "other": expected}
        assert {rid: out.finish_reason for rid, out in finals.items()} == {
            "stuck": "stop",
            "other": "length",
        }
        assert eng.allocator.num_free_blocks == eng.config.kv_blocks
    assert eng.stats.drafted > 0  # drafts did run through the position that has no token


def test_an_answer_with_no_first_token_is_empty(model: TransformerLM) -> None:
    """Settings that leave no first token (the only allowed token is a bad word): the answer
    is empty and stops, from a local prefill and from a whole remote one alike."""
    from cluster.prefill import PrefillWorker
    from workers.engine.outputs import Prefilled

    (prompt,) = prompts(1, seed=19)
    none_left = dataclasses.replace(GREEDY, allowed_token_ids=(7,), bad_words=((7,),))
    plain = SequentialEngine(model, max_model_len=512).generate(prompt, none_left)
    assert (plain.token_ids, plain.finish_reason) == ([], "stop")
    (local,) = engine(model).generate([prompt], none_left)
    assert (local.token_ids, local.finish_reason) == ([], "stop")
    result = PrefillWorker(model, max_model_len=256).compute(prompt, hidden_layers=())
    eng = engine(model)
    eng.add_request("r", prompt, none_left, prefilled=Prefilled(result.kv, None, result.logits))
    (out,) = eng.take_outputs()
    assert (out.new_token_ids, out.finished, out.finish_reason) == ([], True, "stop")
    assert not eng.has_unfinished_requests()
    assert eng.allocator.num_free_blocks == eng.config.kv_blocks
