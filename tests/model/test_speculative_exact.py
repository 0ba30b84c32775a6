"""Speculative decoding is lossless on the bundled model (fp32): greedy output identical to
plain decoding for every drafter and batch size, requests arriving at different times; seeded
sampling independent of what else is in the batch."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import pytest
import torch

from kernels.linear import row_independent_rows
from tests.model.helpers import plain_tokens, run_staggered
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import LoopConfig
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Continuation
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import SpecStats
from workers.model.loader import build_model, truncate_layers

pytestmark = pytest.mark.slow

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "<|im_start|>user\nRepeat after me: red green blue red green blue<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Once upon a time",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is",
    "import os\nimport sys\nimport json\n",
    "Summarize: cats sleep a lot. Cats sleep most of the day because",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)
SPEC = SpecConfig(num_speculative_tokens=4, adaptive=False, disable_batch_size=64)


@pytest.fixture(scope="module")
def prompt_ids(checkpoint) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [checkpoint.tokenizer.encode(t) for t in prompt_texts()]


def prompt_texts() -> list[str]:
    """16 prompts of different lengths: the texts, and the texts with a prefix."""
    return TEXTS + [f"Note {i}. {t}" for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def expected(model_fp32, checkpoint, prompt_ids) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return plain_tokens(model_fp32, checkpoint.config.eos_token_ids, prompt_ids, GREEDY)


@pytest.fixture(scope="module")
def draft_net(checkpoint):  # type: ignore[no-untyped-def]
    return build_model(truncate_layers(checkpoint, 8))


def make_drafter(method: str, draft_net, model_fp32) -> Drafter:  # type: ignore[no-untyped-def]
    """A drafter by test name; `_sure` ends a model drafter's drafts where it doubts them,
    `eagle_loop` drafts greedy sequences in the capture-ready draft loop (run eagerly here)."""
    min_confidence = 0.0
    if method.endswith("_sure"):
        method, min_confidence = method.removesuffix("_sure"), 0.4
    loop = None
    if method.startswith("eagle_loop"):
        method = "eagle" + method.removeprefix("eagle_loop")
        loop = LoopConfig(max_seqs=8, max_depth=SPEC.num_speculative_tokens)
    if method == "ngram":
        return NgramDrafter(NgramConfig(1, 4))
    if method == "suffix":
        return SuffixDrafter(NgramConfig(1, 4))
    if method in ("eagle", "eagle_lookup"):
        lookup = NgramConfig(2, 4) if method == "eagle_lookup" else None
        return EagleDrafter(
            load_head(BUNDLED_HEAD),
            model_fp32,
            num_blocks=1024,
            lookup=lookup,
            min_confidence=min_confidence,
            loop=loop,
        )
    net = model_fp32 if method == "self_draft" else draft_net
    return DraftModelDrafter(net, num_blocks=1024, min_confidence=min_confidence)


def make_engine(  # type: ignore[no-untyped-def]
    model_fp32, checkpoint, drafter: Drafter, spec: SpecConfig = SPEC, **config: int
) -> LLMEngine:
    return LLMEngine(
        model_fp32,
        EngineConfig(max_model_len=512, spec=spec, **config),  # type: ignore[arg-type]
        eos_token_ids=checkpoint.config.eos_token_ids,
        drafters={drafter.method: drafter},
    )


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "self_draft"])
def test_greedy_identical_to_plain_decoding(
    method: str,
    batch: int,
    model_fp32,
    checkpoint,
    draft_net,
    prompt_ids,
    expected,  # type: ignore[no-untyped-def]
) -> None:
    if method == "self_draft" and batch == 16:
        pytest.skip("the full model as its own draft is slow; batches 1 and 4 cover it")
    drafter = make_drafter(method, draft_net, model_fp32)
    engine = make_engine(model_fp32, checkpoint, drafter)
    got = run_staggered(engine, prompt_ids[:batch], GREEDY, RequestSpec(method=drafter.method))
    assert got == expected[:batch]
    assert engine.stats.drafted > 0
    if method == "self_draft":
        assert engine.stats.accepted == engine.stats.drafted  # a model always agrees with itself
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


class AheadEveryStep(Drafter):
    """A drafter that drafts ahead after every proposal, as a drafter actor does while the
    verifier works (cluster/drafter_worker.py), here in step with the engine. With
    `abandon_at`, every other time drafting ahead is abandoned at that check of `abandon` (a
    draft model checks before each forward and after each layer), as when the next step
    arrives with a commit that cannot be the guess."""

    def __init__(self, inner: Drafter, abandon_at: int | None = None) -> None:
        self.inner = inner
        self.method = inner.method
        self.hidden_layers = inner.hidden_layers
        self.abandon_at = abandon_at
        self.calls = 0

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.inner.add(request_id, prompt_token_ids, params)

    def observe_hidden(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        self.inner.observe_hidden(request_id, first_position, hidden)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.inner.commit(request_id, token_ids)

    def remove(self, request_id: str) -> None:
        self.inner.remove(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        drafts = self.inner.propose(requests)
        self.calls += 1
        checks = itertools.count()
        at = self.abandon_at
        if at is not None and self.calls % 2:
            self.inner.draft_ahead(requests, abandon=lambda: next(checks) >= at)
        else:
            self.inner.draft_ahead(requests)
        return drafts


@pytest.mark.parametrize(
    ("method", "abandon_at"),
    [
        ("self_draft", None),
        ("draft_model", None),
        ("draft_model", 5),  # inside the first forward, after its fifth layer
        ("eagle", None),
        ("eagle_lookup", None),
    ],
)
def test_drafting_ahead_stays_exact(
    method: str,
    abandon_at: int | None,
    model_fp32,
    checkpoint,
    draft_net,
    prompt_ids,
    expected,  # type: ignore[no-untyped-def]
) -> None:
    inner = make_drafter(method, draft_net, model_fp32)
    engine = make_engine(model_fp32, checkpoint, AheadEveryStep(inner, abandon_at))
    got = run_staggered(engine, prompt_ids[:4], GREEDY, RequestSpec(method=inner.method))
    assert got == expected[:4]
    assert inner.ahead_prepared > 0
    if method == "self_draft":  # whole drafts accepted, the guessed bonus token right
        assert inner.ahead_served > 0


@pytest.mark.parametrize(
    ("batch", "drafter"),
    [
        (1, "eagle"),
        (8, "eagle"),
        (8, "eagle_lookup"),
        (8, "eagle_sure"),
        (8, "eagle_loop_sure"),
        (8, "draft_model_sure"),
    ],
)
def test_eagle_and_drafts_ended_by_confidence_identical_to_plain_decoding(
    batch: int,
    drafter: str,
    model_fp32,
    checkpoint,
    draft_net,
    prompt_ids,
    expected,  # type: ignore[no-untyped-def]
) -> None:
    """EAGLE, and model drafts that end where the drafter doubts them (`_sure`)."""
    chosen = make_drafter(drafter, draft_net, model_fp32)
    engine = make_engine(model_fp32, checkpoint, chosen)
    got = run_staggered(engine, prompt_ids[:batch], GREEDY, RequestSpec(method=chosen.method))
    assert got == expected[:batch]
    assert engine.stats.accepted > 0  # quality is measured by bench_eagle, not asserted here
    if isinstance(chosen, EagleDrafter) and chosen.loop is not None:
        assert chosen.loop.num_eager_runs > 0
    if drafter.endswith("_sure"):
        reached = engine.stats.drafted_per_position
        assert reached[3] < reached[0]  # some drafts ended early
    assert engine.allocator.num_free_blocks == engine.config.kv_blocks


def test_eagle_exact_through_prefix_caching_and_preemption(
    model_fp32,
    checkpoint,
    draft_net,
    prompt_ids,
    expected,  # type: ignore[no-untyped-def]
) -> None:
    """Prompts sharing cached prefix blocks (the drafter gets no features for them) and a KV
    cache so small that sequences are preempted and recomputed."""
    shared = checkpoint.tokenizer.encode("Here is a long shared preamble for every request. " * 4)
    prompts = [shared + p for p in prompt_ids[:6]]
    want = plain_tokens(model_fp32, checkpoint.config.eos_token_ids, prompts, GREEDY)
    drafter = make_drafter("eagle_loop_lookup", draft_net, model_fp32)
    assert isinstance(drafter, EagleDrafter) and drafter.loop is not None
    engine = make_engine(model_fp32, checkpoint, drafter, num_kv_blocks=24, block_size=16)
    assert run_staggered(engine, prompts, GREEDY, RequestSpec(method="eagle"), gap=3) == want
    assert engine.stats.accepted > 0
    assert drafter.looked_up > 0  # the repeated preamble: prompt lookup took turns with the head
    assert drafter.loop.num_eager_runs > 0  # and the head drafted in the loop
    assert drafter.allocator.num_free_blocks == drafter.allocator.num_blocks


def test_adaptive_k_and_batch_fallback_stay_exact(
    model_fp32, checkpoint, prompt_ids, expected
) -> None:  # type: ignore[no-untyped-def]
    spec = SpecConfig(method="ngram", num_speculative_tokens=6, disable_batch_size=3)
    engine = make_engine(model_fp32, checkpoint, NgramDrafter(NgramConfig(1, 4)), spec)
    assert run_staggered(engine, prompt_ids[:6], GREEDY, RequestSpec(), gap=3) == expected[:6]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle_sure"])
def test_seeded_sampling_does_not_depend_on_the_batch(
    method: str,
    model_fp32,
    checkpoint,
    draft_net,
    prompt_ids,  # type: ignore[no-untyped-def]
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234)
    others = SamplingParams(max_tokens=20, temperature=1.0, seed=99)
    runs = []
    for company in (0, 3):
        drafter = make_drafter(method, draft_net, model_fp32)
        engine = make_engine(model_fp32, checkpoint, drafter)
        spec = RequestSpec(method=drafter.method)
        engine.add_request("target", prompt_ids[0], params, spec)
        for i in range(company):
            engine.add_request(f"other{i}", prompt_ids[i + 1], others, spec)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "target":
                    tokens += out.new_token_ids
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert len(runs[0]) > 0


@pytest.mark.parametrize(
    ("dtype", "batch", "k"),
    [(torch.bfloat16, 1, 16), (torch.bfloat16, 4, 8), (torch.float32, 4, 8)],
)
def test_greedy_is_identical_to_plain_decoding_on_the_native_kernels(
    checkpoint,  # type: ignore[no-untyped-def]
    prompt_ids: list[list[int]],
    dtype: torch.dtype,
    batch: int,
    k: int,
) -> None:
    """In bf16 and fp32 alike the speculative path commits exactly what plain decoding does, by
    construction rather than by the luck of no near-ties: our projections and attention, and
    the norms, compute each token's row from its own inputs alone (kernels/native.py), so a
    token's logits do not depend on how many tokens its forward verified nor on the other
    requests in it (ties included)."""
    if row_independent_rows(dtype) < 36:
        pytest.skip("needs our native kernels for every row of a 36-token verification")
    model = build_model(checkpoint, dtype=dtype)
    eos = checkpoint.config.eos_token_ids
    params = SamplingParams(max_tokens=40, temperature=0)
    prompts = prompt_ids[:batch] if batch == 1 else prompt_ids[1 : 1 + batch]
    expected = plain_tokens(model, eos, prompts, params)
    spec = SpecConfig(num_speculative_tokens=k, adaptive=False, disable_batch_size=64)
    drafter = NgramDrafter(NgramConfig(1, 4))
    engine = LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=spec),
        eos_token_ids=eos,
        drafters={drafter.method: drafter},
    )
    got = run_staggered(engine, prompts, params, RequestSpec(method="ngram"))
    assert got == expected
    assert engine.stats.accepted > 0 and engine.stats.drafted > engine.stats.accepted


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle_lookup"])
def test_a_predicted_output_drafts_and_changes_nothing(  # type: ignore[no-untyped-def]
    method: str, model_fp32, checkpoint, draft_net, prompt_ids, expected
) -> None:
    """OpenAI's predicted output: drafts copy it (from the answer's first token, and again
    after a stretch the answer does not share); the output is plain decoding's, whether the
    prediction is right, edited or wrong, and a right one is accepted far more often."""
    # Each of the first eight requests predicts its own answer, with one token in the middle
    # changed for the odd ones; the last two predict another request's answer.
    predictions = [list(e) for e in expected[:8]]
    for i in range(1, 8, 2):
        predictions[i][10] = (predictions[i][10] + 1) % 1000
    predictions[6], predictions[7] = expected[9], expected[10]
    params = [
        SamplingParams(max_tokens=24, temperature=0, prediction=tuple(p)) for p in predictions
    ]
    engine = make_engine(model_fp32, checkpoint, make_drafter(method, draft_net, model_fp32))
    got = engine.generate(prompt_ids[:8], params, RequestSpec(method=method.split("_")[0]))
    assert [g.token_ids for g in got] == expected[:8]
    right = [got[i].spec.mean_acceptance_length for i in (0, 2, 4)]
    assert min(right) > 3.0, right  # four drafts a step, nearly all accepted
    assert got[1].spec.mean_acceptance_length > 2.0  # picked up again after the edit


def _steps(engine: LLMEngine, request_id: str) -> list[tuple[list[int], str, SpecStats]]:
    """A lone request's steps to its end: (new tokens, new text, its statistics after)."""
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and (out.new_token_ids or out.text):
                steps.append((out.new_token_ids, out.text, copy.deepcopy(out.spec)))
    return steps


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_continued_on_another_engine_goes_on_as_in_one_run(  # type: ignore[no-untyped-def]
    method: str, temperature: float, model_fp32, checkpoint, draft_net, prompt_ids
) -> None:
    """A request cut after a few steps and continued on a fresh engine with its output and
    statistics (`Continuation`, what the router migrates) gives the tokens, text and
    statistics of one uninterrupted run: greedy, and seeded sampled (its draws keyed by
    position), with a stop string watched across the seam."""
    params = SamplingParams(
        max_tokens=28, temperature=temperature, seed=7, stop=("never said",), ignore_eos=True
    )
    spec = RequestSpec(method=method)

    def fresh() -> LLMEngine:
        drafter = make_drafter(method, draft_net, model_fp32)
        return LLMEngine(
            model_fp32,
            EngineConfig(max_model_len=512, spec=SPEC),
            tokenizer=checkpoint.tokenizer,
            eos_token_ids=checkpoint.config.eos_token_ids,
            drafters={drafter.method: drafter},
        )

    one_run = fresh()
    one_run.add_request("r", prompt_ids[0], params, spec)
    steps = _steps(one_run, "r")
    tokens = [t for new, _, _ in steps for t in new]
    assert len(tokens) == 28
    cut = next(i for i in range(len(steps)) if sum(len(s[0]) for s in steps[: i + 1]) >= 9)
    before = [t for new, _, _ in steps[: cut + 1] for t in new]
    moved = fresh()
    moved.add_request(
        "r", prompt_ids[0], params, spec, continuation=Continuation(tuple(before), steps[cut][2])
    )
    rest = _steps(moved, "r")
    assert before + [t for new, _, _ in rest for t in new] == tokens
    text = "".join(piece for _, piece, _ in steps)
    assert "".join(p for _, p, _ in steps[: cut + 1]) + "".join(p for _, p, _ in rest) == text
    assert rest[-1][2] == steps[-1][2]  # the statistics of one run, each step counted once
    assert steps[-1][2].drafted > 0
