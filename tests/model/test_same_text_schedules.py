"""Same request, same text, under random schedules: on the bundled model in every dtype and weight
format a CPU deployment offers, requests arriving at random steps into an engine with a small
step budget (prefill in chunks, drafts cut short), few KV blocks (preemption and recompute), a
prompt asked twice (the prefix cache), a prompt prefilled by a prefill worker, a request moved
part-way to another engine (a verifier's failure) and speculation beside plain decoding each get
the tokens they get alone: greedy ones what plain decoding gives, seeded sampled ones what the
same request draws alone in an engine of its own."""

from __future__ import annotations

import random

import pytest

from cluster.prefill import PrefillWorker
from tests.conftest import CPU_FORMATS
from tests.model.test_speculative_exact import prompt_texts
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Continuation, Prefilled
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.transformer import TransformerLM

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=20, temperature=0)
NGRAM, PLAIN = RequestSpec(method="ngram"), RequestSpec(method="none")


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed)


def test_a_random_schedule_gives_each_request_its_text_alone(
    checkpoint,  # type: ignore[no-untyped-def]
    cpu_format_model: TransformerLM,
    request: pytest.FixtureRequest,
) -> None:
    model = cpu_format_model
    eos = checkpoint.config.eos_token_ids
    dtype, quantization = CPU_FORMATS[request.node.callspec.id]
    rng = random.Random(f"{dtype}-{quantization}")  # the same schedule for a format each run
    texts = prompt_texts()
    prompts = [checkpoint.tokenizer.encode(texts[i]) for i in rng.sample(range(len(texts)), 6)]
    first = max(range(len(prompts)), key=lambda n: len(prompts[n]))
    prompts.append(prompts[first])  # asked again once its prompt is in: the prefix cache
    repeat = len(prompts) - 1
    requests = [
        (p, GREEDY, NGRAM) if n % 3 else (p, sampled(100 + n), PLAIN) for n, p in enumerate(prompts)
    ]
    plain = SequentialEngine(model, eos_token_ids=eos, max_model_len=512)
    expected = []
    for prompt, params, spec in requests:
        if params.greedy:
            expected.append(plain.generate(prompt, params).token_ids)
        else:  # the same request alone in an engine of its own
            alone = LLMEngine(model, EngineConfig(max_model_len=512), eos_token_ids=eos)
            expected.append(alone.generate([prompt], params, spec)[0].token_ids)

    k = rng.randint(2, 6)
    config = EngineConfig(
        max_model_len=512,
        max_num_batched_tokens=rng.choice([16, 24, 40]),  # chunks, and drafts cut short
        num_kv_blocks=8,  # two or three of these requests: the rest wait or are preempted
        spec=SpecConfig(num_speculative_tokens=k, adaptive=False, disable_batch_size=64),
    )
    engines = [
        LLMEngine(
            model, config, eos_token_ids=eos, drafters={"ngram": NgramDrafter(NgramConfig(1, 4))}
        )
        for _ in range(2)
    ]
    engine, other = engines
    # One request prefilled by a prefill worker (its whole prompt: the engine samples the first
    # token from the worker's logits), one moved to the other engine after a few tokens.
    prefilled, moved = rng.sample([n for n in range(repeat) if n != first], 2)
    move_after, has_moved = rng.randint(2, 8), False
    worker = PrefillWorker(model, max_model_len=512, block_size=config.block_size)
    arrivals = sorted((rng.randint(0, 12), n) for n in range(repeat))
    tokens: dict[str, list[int]] = {f"r{n}": [] for n in range(len(requests))}
    step = 0
    while arrivals or any(e.has_unfinished_requests() for e in engines):
        while arrivals and arrivals[0][0] <= step:
            _, n = arrivals.pop(0)
            prompt, params, spec = requests[n]
            remote = None
            if n == prefilled:
                result = worker.compute(prompt, ())
                remote = Prefilled(result.kv, None, result.logits)
            engine.add_request(f"r{n}", prompt, params, spec, prefilled=remote)
        for out in [out for e in engines for out in e.step()]:
            tokens[out.request_id] += out.new_token_ids
            if out.request_id == f"r{first}" and len(tokens[out.request_id]) == 1:
                arrivals = sorted([*arrivals, (step + 1, repeat)])
            rid = f"r{moved}"
            due = len(tokens[rid]) >= move_after and not (out.finished or has_moved)
            if out.request_id == rid and due:
                engine.abort_request(rid)
                engine.take_outputs()  # the abort's: its client has moved on
                prompt, params, spec = requests[moved]
                other.add_request(
                    rid, prompt, params, spec, continuation=Continuation(tuple(tokens[rid]))
                )
                has_moved = True
        step += 1
    got = [tokens[f"r{n}"] for n in range(len(requests))]
    assert got == expected
    assert has_moved
    # The schedule did what it was meant to: preempted, hit the prefix cache, and accepted drafts.
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.prefix_hit_tokens > 0
    assert engine.stats.accepted > 0
