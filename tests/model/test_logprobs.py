"""Log-probabilities of generated tokens (fp32, bundled model): the target's own distribution at
each position, as transformers computes it, whatever the request samples with, and the same
with speculation as without."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import speculative_engine
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.llm_engine import LLMEngine
from workers.engine.logprobs import TokenLogprob, token_logprobs
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is",
]


def test_token_logprobs_are_log_softmax_rows() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0]])
    logp = torch.log_softmax(logits, dim=-1)
    got = token_logprobs(logits, [1, 0], 2)
    assert [g.token_id for g in got] == [1, 0]
    assert got[0].logprob == pytest.approx(float(logp[0, 1]))
    assert [i for i, _ in got[0].top] == [3, 2]
    assert got[0].top[0][1] == pytest.approx(float(logp[0, 3]))
    assert got[1].top[0] == (0, pytest.approx(float(logp[1, 0])))
    assert token_logprobs(logits, [2, 3], 0) == [
        TokenLogprob(2, pytest.approx(float(logp[0, 2])), rank=2),  # type: ignore[arg-type]
        TokenLogprob(3, pytest.approx(float(logp[1, 3])), rank=2),  # type: ignore[arg-type]
    ]
    assert [g.rank for g in got] == [3, 1]  # ties share the better rank
    assert token_logprobs(logits[:1], [], 3) == []


def test_logprobs_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


@pytest.mark.slow
def test_logprobs_are_the_targets_raw_distribution(  # type: ignore[no-untyped-def]
    model_fp32, checkpoint, hf_model
) -> None:
    """Greedy and sampled (temperature 0.7, top-k 20) requests batched together: each token's
    log-probability and its top 5 are transformers' log-softmax of the same position, before
    the sampling transform; a greedy token is its position's likeliest."""
    engine = LLMEngine(
        model_fp32,
        EngineConfig(max_model_len=512),
        eos_token_ids=checkpoint.config.eos_token_ids,
    )
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS[:2]]
    params = [
        SamplingParams(max_tokens=12, temperature=0, logprobs=5),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=3, logprobs=5),
    ]
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.logprobs) == len(result.token_ids) > 0
        ids = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            expected = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
        rows = expected[len(prompt) - 1 : -1]
        for row, token, got in zip(rows, result.token_ids, result.logprobs, strict=True):
            assert got.token_id == token
            assert got.logprob == pytest.approx(float(row[token]), abs=2e-3)
            top = row.topk(5)
            assert [i for i, _ in got.top] == top.indices.tolist()
            assert [v for _, v in got.top] == pytest.approx(top.values.tolist(), abs=2e-3)
    greedy = results[0]
    assert all(lp.top[0][0] == lp.token_id for lp in greedy.logprobs)
    plain = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0))[0]
    assert plain.token_ids == greedy.token_ids and plain.logprobs == []


def _close(a: list[TokenLogprob], b: list[TokenLogprob]) -> bool:
    return all(
        x.token_id == y.token_id
        and abs(x.logprob - y.logprob) < 1e-4
        and [i for i, _ in x.top] == [i for i, _ in y.top]
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_logprobs_with_speculation_equal_plain_decoding(  # type: ignore[no-untyped-def]
    method: str, model_fp32, checkpoint
) -> None:
    """Requests arriving at different steps; drafts accepted past `max_tokens` are cut with
    their log-probabilities, so each step's output has one per new token."""
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=3) for n in (21, 7, 24, 13)]
    plain = LLMEngine(
        model_fp32, EngineConfig(max_model_len=512), eos_token_ids=checkpoint.config.eos_token_ids
    ).generate(prompts, params)
    engine = speculative_engine(method, model_fp32, checkpoint.config.eos_token_ids)
    got = {f"r{i}": Completion(f"r{i}", p) for i, p in enumerate(prompts)}
    step = 0
    while step < 2 * len(prompts) or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            engine.add_request(f"r{i}", prompts[i], params[i], RequestSpec(method=method))
        for out in engine.step():
            assert len(out.logprobs) == len(out.new_token_ids)
            got[out.request_id].token_ids += out.new_token_ids
            got[out.request_id].logprobs += out.logprobs
        step += 1
    assert engine.stats.accepted > 0
    for result, expected in zip(got.values(), plain, strict=True):
        assert result.token_ids == expected.token_ids
        assert _close(result.logprobs, expected.logprobs)


@pytest.mark.slow
def test_prompt_logprobs_score_every_prompt_position(model_fp32, checkpoint, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The prompt is computed whole (its blocks already in the prefix cache from an earlier
    request) in chunks of 16 tokens, beside n-gram drafts of another request: one entry per
    prompt token after the first, transformers' log-softmax, and the same answer as without."""
    from dataclasses import replace

    eos = checkpoint.config.eos_token_ids
    engine = speculative_engine("ngram", model_fp32, eos, max_num_batched_tokens=16)
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS[:2]]
    plain = SamplingParams(max_tokens=8, temperature=0)
    spec = RequestSpec(method="ngram")
    before = engine.generate(prompts, plain, spec)
    assert engine.cached_prefix_tokens(prompts[0]) > 0
    scored = replace(plain, prompt_logprobs=3)
    got = engine.generate(prompts, [scored, plain], spec)
    assert [g.token_ids for g in got] == [b.token_ids for b in before]
    assert got[1].prompt_logprobs is None
    entries = got[0].prompt_logprobs
    prompt = prompts[0]
    assert entries is not None and [e.token_id for e in entries] == prompt[1:]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for row, entry in zip(expected[:-1], entries, strict=True):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=2e-3)
        assert [i for i, _ in entry.top] == row.topk(3).indices.tolist()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
