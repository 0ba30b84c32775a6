"""Remote prefill into the engine (a prefill worker's K/V, hidden states and last logits), on a
tiny random model: the same tokens as prefilling locally, with no prompt token computed twice."""

from __future__ import annotations

import pytest

from cluster.prefill import PrefillWorker
from tests.unit.test_engine import engine, model, prompts, reference
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Prefilled
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

__all__ = ["model"]  # the module-scoped fixture, shared


def run_counting_prompt_tokens(eng: LLMEngine, outputs: dict[str, list[int]]) -> int:
    """Step `eng` to the end, appending each request's tokens to `outputs`; how many prompt
    tokens the engine itself computed on the way."""
    computed_prompt_tokens = 0
    while eng.has_unfinished_requests():
        scheduled = eng.scheduler.running + list(eng.scheduler.waiting)
        computed_prompt_tokens += sum(
            s.num_uncomputed_tokens for s in scheduled if not s.output_token_ids
        )
        for out in eng.step():
            outputs[out.request_id] += out.new_token_ids
    return computed_prompt_tokens


def test_a_remote_prefill_lands_in_the_cache_and_changes_nothing(model: TransformerLM) -> None:
    """A prefill worker's K/V (and hidden states) for all but the last prompt token, written
    into the engine's blocks, give the same tokens as prefilling here."""

    ps = prompts(3, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = reference(model, ps, params)
    worker = PrefillWorker(model, max_model_len=256, block_size=8)
    eng = engine(model, block_size=8)
    for i, p in enumerate(ps):
        result = worker.compute(p[:-1], hidden_layers=(1,))
        kv = result.kv
        assert kv.shape == (2, 2, len(p) - 1, 2, 8) and result.hidden[1].shape == (len(p) - 1, 32)
        eng.add_request(f"r{i}", p, params, prefilled=Prefilled(kv))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    computed_prompt_tokens = run_counting_prompt_tokens(eng, outputs)
    assert [outputs[f"r{i}"] for i in range(len(ps))] == expected
    assert computed_prompt_tokens == len(ps)  # only each prompt's last token ran here
    with pytest.raises(ValueError, match="shorter than the prompt"):
        eng.add_request("whole", ps[0], params, prefilled=Prefilled(worker.compute(ps[0], ()).kv))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_whole_remote_prefill_samples_the_first_token_without_a_forward(
    model: TransformerLM, temperature: float
) -> None:
    """With the whole prompt's K/V and its last logits, the engine samples the first token at
    once (the same draw, seeded, as a local prefill) and runs no prompt token itself."""

    ps = prompts(3, seed=12)
    params = [
        SamplingParams(max_tokens=6, temperature=temperature, seed=100 + i, ignore_eos=True)
        for i in range(len(ps))
    ]
    local = engine(model, block_size=8)
    expected = [c.token_ids for c in local.generate(ps, params)]
    worker = PrefillWorker(model, max_model_len=256, block_size=8)
    eng = engine(model, block_size=8)
    first: dict[str, list[int]] = {}
    for i, p in enumerate(ps):
        result = worker.compute(p, hidden_layers=())
        assert result.logits.shape == (model.config.vocab_size,)
        eng.add_request(f"r{i}", p, params[i], prefilled=Prefilled(result.kv, None, result.logits))
    for out in eng.take_outputs():  # before any step: the first tokens are out already
        first[out.request_id] = out.new_token_ids
    assert all(len(first[f"r{i}"]) == 1 for i in range(len(ps)))
    outputs = {rid: list(tokens) for rid, tokens in first.items()}
    computed_prompt_tokens = run_counting_prompt_tokens(eng, outputs)
    assert [outputs[f"r{i}"] for i in range(len(ps))] == expected
    assert computed_prompt_tokens == 0
    one = SamplingParams(max_tokens=1, temperature=0)
    result = worker.compute(ps[0], hidden_layers=())
    eng.add_request("one", ps[0], one, prefilled=Prefilled(result.kv, None, result.logits))
    (done,) = eng.take_outputs()
    assert done.finished and done.finish_reason == "length" and not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="whole prompt"):
        eng.add_request(
            "short", ps[0], one, prefilled=Prefilled(result.kv[:, :, :-1], None, result.logits)
        )
