"""Async scheduling (workers/engine/overlap.py, async_steps.py): plain decode steps launched
before the host has read the step before them commit what the synchronous engine commits, token
for token, through the CPU's runner and the graph runner's padded path, as requests arrive, stop
early, reach their length, are aborted, sample, penalize, speculate, and run out of KV blocks;
steps are timed commit to commit; on a GPU the host's commit overlaps the next step."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.attention_uniform import UniformTorchAttention
from kernels.host_copy import queued_tensor
from tests.factories import tiny_model
from tests.unit.test_cuda import prompts
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.graph_runner import GraphRunner
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.outputs import StepReport
from workers.engine.sampler import DeviceSampler, Sampler
from workers.engine.sampling_params import SamplingParams
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM

EOS = 1
BLOCK = 8
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=6, max_position_embeddings=512)


def make_engine(
    model: TransformerLM,
    runner: str,
    overlap: bool,
    kv_blocks: int = 0,
    ngram: bool = False,
    sampler: Sampler | None = None,
    max_num_seqs: int = 16,
) -> LLMEngine:
    spec = SpecConfig(num_speculative_tokens=3, adaptive=False, disable_batch_size=4)
    config = EngineConfig(
        max_model_len=256,
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        num_kv_blocks=kv_blocks,
        async_scheduling=overlap,
        spec=spec,
    )
    graphs = None
    if runner == "padded":
        blocks = config.kv_blocks
        cache = PagedKVCache(model.config, blocks + 1, BLOCK, model.dtype, model.device)
        graphs = GraphRunner(
            model,
            cache,
            attention=UniformTorchAttention(),
            max_num_seqs=16,
            max_width=4,
            max_graph_tokens=512,
            scratch_block=blocks,
        )
    drafters = {"ngram": NgramDrafter(NgramConfig(1, 3))} if ngram else {}
    return LLMEngine(
        model, config, eos_token_ids=[EOS], runner=graphs, drafters=drafters, sampler=sampler
    )


def requests(n: int) -> list[tuple[list[int], SamplingParams, RequestSpec]]:
    """Greedy requests of several lengths, some stopped by EOS; a seeded sampled one and a
    penalized one (each runs its steps synchronously)."""
    out = []
    for i, prompt in enumerate(prompts(n, seed=11)):
        params = SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=i % 3 != 0)
        if i == 5:
            params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
        if i == 7:
            params = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.5)
        out.append((prompt, params, RequestSpec(enabled=False)))
    return out


def serve(
    engine: LLMEngine,
    work: list[tuple[list[int], SamplingParams, RequestSpec]],
    gap: int,
    abort: tuple[int, int] | None = None,
) -> dict[str, tuple[list[int], str | None]]:
    """Request i arrives at step i * gap (request `abort[0]` aborted at step `abort[1]`); each
    request's tokens and finish reason."""
    got: dict[str, tuple[list[int], str | None]] = {}
    step = 0
    while step <= len(work) * gap or engine.has_unfinished_requests():
        for i, (prompt, params, spec) in enumerate(work):
            if i * gap == step:
                engine.add_request(f"r{i}", prompt, params, spec)
        if abort is not None and step == abort[1]:
            engine.abort_request(f"r{abort[0]}")
        for out in engine.step():
            tokens, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        step += 1
    return got


@pytest.mark.parametrize("runner", ["eager", "padded"])
def test_async_steps_commit_what_synchronous_steps_do(model: TransformerLM, runner: str) -> None:
    work = requests(12)
    whole = serve(make_engine(model, runner, False), work, 1)
    assert any(reason == "stop" for _, reason in whole.values())  # EOS ended some early
    for gap, kv_blocks in [(1, 0), (0, 14), (3, 0)]:
        expected = serve(make_engine(model, runner, False, kv_blocks), work, gap)
        engine = make_engine(model, runner, True, kv_blocks)
        assert serve(engine, work, gap) == expected == whole, (gap, kv_blocks)
        assert engine.num_async_steps > 0
        if kv_blocks:  # too few blocks for everyone: preempted, and async steps fell back
            assert engine.scheduler.num_preemptions > 0
    # A full batch (4 of 12) admits nobody: its steps go ahead while the others wait.
    full = make_engine(model, runner, True, max_num_seqs=4)
    assert serve(full, work, 0) == serve(make_engine(model, runner, False, max_num_seqs=4), work, 0)
    assert full.num_async_steps > 20
    # Aborted mid-answer: what it got so far is its answer's start (an async engine commits a
    # step later than a synchronous one), and the others are untouched.
    got = serve(make_engine(model, runner, True), work, 3, abort=(2, 9))
    tokens, reason = got.pop("r2")
    assert reason == "abort" and tokens == whole["r2"][0][: len(tokens)]
    assert got == {rid: out for rid, out in whole.items() if rid != "r2"}


@pytest.mark.parametrize("runner", ["eager", "padded"])
def test_seeded_sampled_requests_go_ahead_with_a_device_sampler(
    model: TransformerLM, runner: str
) -> None:
    """With the device sampler (counter-based draws keyed by request and position), sampled
    requests go ahead too, each drawing the tokens the synchronous engine draws."""
    work = [
        (p, SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.9, seed=i), RequestSpec())
        for i, p in enumerate(prompts(10, seed=8))
    ]
    work[3] = (work[3][0], SamplingParams(max_tokens=12, temperature=0), RequestSpec())
    work[6] = (
        work[6][0],
        SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=1),
        RequestSpec(),
    )
    expected = serve(make_engine(model, runner, False, sampler=DeviceSampler()), work, 1)
    engine = make_engine(model, runner, True, sampler=DeviceSampler())
    assert serve(engine, work, 1) == expected
    assert engine.num_async_steps > 10
    assert serve(make_engine(model, runner, True), work, 1) == serve(
        make_engine(model, runner, False), work, 1
    )  # the host sampler: sampled requests run their steps synchronously


def test_speculation_runs_synchronously_below_disable_batch_size(model: TransformerLM) -> None:
    """n-gram drafting where fewer than `disable_batch_size` requests are unfinished; async
    plain decode steps at and above it."""
    work = [(p, SamplingParams(max_tokens=24, temperature=0), RequestSpec(method="ngram"))
            for p in prompts(8, seed=5)]  # fmt: skip
    expected = serve(make_engine(model, "eager", False, ngram=True), work, 4)
    engine = make_engine(model, "eager", True, ngram=True)
    assert serve(engine, work, 4) == expected
    assert engine.num_async_steps > 0 and engine.stats.accepted > 0


@pytest.mark.parametrize("runner", ["eager", "padded"])
def test_fed_tokens_replace_the_staged_ones(model: TransformerLM, runner: str) -> None:
    """`input_tokens` (on the model's device) stand in for each sequence's one host token."""
    engine = make_engine(model, runner, False)
    forwards = [SeqForward([5], 0, [0]), SeqForward([9], 0, [1])]
    fed = make_engine(model, runner, False).runner.forward(
        [SeqForward([0], 0, [0]), SeqForward([0], 0, [1])], input_tokens=torch.tensor([5, 9])
    )
    plain = engine.runner.forward(forwards)
    assert torch.equal(fed.output.logits, plain.output.logits)
    with pytest.raises(ValueError, match="one new token a sequence"):
        engine.runner.forward([SeqForward([3, 4], 0, [0])], input_tokens=torch.tensor([5]))
    assert ModelRunner.feeds_tokens


@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_async_steps_on_cuda_with_graphs(_: None) -> None:
    """On a GPU, with graphs captured and the tokens read back through pinned memory after an
    event: the synchronous engine's tokens, fp32."""
    from workers.engine.graph_runner import GraphRunner as Graphs

    cuda_model = tiny_model(seed=6, max_position_embeddings=512).to("cuda")
    work = requests(12)
    got = []
    for overlap in (False, True):
        config = EngineConfig(
            max_model_len=256, block_size=BLOCK, max_num_seqs=16, async_scheduling=overlap
        )
        engine = LLMEngine(cuda_model, config, eos_token_ids=[EOS])
        assert isinstance(engine.runner, Graphs)
        got.append(serve(engine, work, 1))
        assert engine.runner.num_replays > 0
    assert got[0] == got[1]
    assert engine.num_async_steps > 0


def test_steps_in_the_pipeline_are_timed_commit_to_commit(model: TransformerLM) -> None:
    """A launched step's report starts where the step before it was committed, not at its
    launch (which came before that commit): the steps' reported spans follow one another
    without overlapping, so a step's time is one period of the pipeline, not two."""
    engine = make_engine(model, "eager", True, max_num_seqs=4)
    reports: list[StepReport] = []
    engine.step_listeners.append(reports.append)
    serve(engine, requests(8), 0)
    assert engine.num_async_steps > 10
    spans = [(r.start_ns / 1e9, r.start_ns / 1e9 + r.draft_s + r.forward_s) for r in reports]
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 1e-3  # a millisecond for time_ns against perf_counter


def test_queued_host_values_are_the_values() -> None:
    """kernels/host_copy.py against torch.tensor (on the CPU the copy is a plain one)."""
    for values, dtype in (([3, 1, 2], torch.int64), ([[1.5, 2.0], [0.0, -1.0]], torch.float32)):
        got = queued_tensor(values, dtype, torch.device("cpu"))
        assert torch.equal(got, torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_the_host_commits_while_the_device_runs_the_next_step(_: None) -> None:
    """Overlap itself: every forward made long on the device (a spin of ~20 ms after it), the
    step a call launches is still running when the call returns, having committed the step
    before, for greedy requests and for those the device sampler draws. A host-to-device copy
    that waits for the device (`torch.tensor(..., device=...)`) after the launch would make it
    done by then."""
    cuda_model = tiny_model(seed=6, max_position_embeddings=512).to("cuda")
    config = EngineConfig(
        max_model_len=256, block_size=BLOCK, max_num_seqs=8, async_scheduling=True,
        enforce_eager=True,
    )  # fmt: skip
    engine = LLMEngine(cuda_model, config, eos_token_ids=[EOS], sampler=DeviceSampler())
    forward = engine.runner.forward

    def slow_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = forward(*args, **kwargs)
        torch.cuda._sleep(40_000_000)  # cycles: ~20 ms at 2 GHz
        return out

    engine.runner.forward = slow_forward  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts(8, seed=3)):
        temperature = 0.0 if i % 2 else 0.8
        engine.add_request(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=12, temperature=temperature, seed=i, ignore_eos=True),
        )
    running_at_return = []
    while engine.has_unfinished_requests():
        engine.step()
        launched = engine.ahead.launched
        if launched is not None and launched.ready is not None:
            running_at_return.append(not launched.ready.query())
    assert engine.num_async_steps > 5
    assert running_at_return and all(running_at_return)
