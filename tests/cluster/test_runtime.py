"""The disaggregated runtime on a real local Ray cluster: greedy output identical to plain
decoding with the drafter pool in its own actors (features over gloo links), a drafter killed
mid-stream, cancellation, and placement by resources on a simulated multi-node cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cluster.config import DeploymentConfig, from_dict
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def deployment(method: str, drafters: int, **drafter: object) -> DeploymentConfig:
    return from_dict(
        {
            "dtype": "float32",
            "speculative": {"method": method, "num_speculative_tokens": 4, "adaptive": False},
            "pools": {
                "prefill": {"replicas": 0},
                "verifier": {"resources": {"cpus": 1}},
                "drafter": {"replicas": drafters, "method": method, **drafter},
            },
            "ray": {"dashboard_port": 8265},
        }
    )


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [checkpoint.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(model_fp32, checkpoint, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=512
    )
    return [plain.generate(p, GREEDY).token_ids for p in prompts]


@pytest.fixture(scope="module")
def eagle_runtime() -> Iterator[object]:
    from cluster.runtime import Runtime

    runtime = Runtime.start(deployment("eagle", drafters=2), num_cpus=3)
    yield runtime
    runtime.shutdown()


def run_all(runtime, prompts, method: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    streams = [runtime.submit(p, GREEDY, RequestSpec(method=method)) for p in prompts]
    return [[t for chunk in s for t in chunk] for s in streams]


def test_eagle_pool_is_exact_and_drafts(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    assert run_all(eagle_runtime, prompts, "eagle") == expected
    (stats,) = eagle_runtime.verifier_stats()
    assert stats["spec"]["accepted"] > 0  # drafts came back from the drafter actors and held
    remote = stats["remote_drafting"]
    assert remote["feature_bytes"] > 0 and remote["failures"] == 0
    info = eagle_runtime.actor_info()
    assert [d["name"] for d in info["drafters"]] == ["drafter-0", "drafter-1"]
    assert {d["pid"] for d in info["drafters"]}.isdisjoint({v["pid"] for v in info["verifiers"]})


def test_killing_a_drafter_mid_stream_keeps_the_output(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    stream = eagle_runtime.submit(prompts[0], GREEDY, RequestSpec(method="eagle"))
    chunks = iter(stream)
    tokens = list(next(chunks))
    for actor in eagle_runtime.drafters:
        ray.kill(actor, no_restart=False)  # Ray restarts them empty
    for chunk in chunks:
        tokens += chunk
    assert tokens == expected[0]
    assert stream.finish_reason == "length"
    # Later requests draft again once the drafters are back and re-fed.
    time.sleep(1.0)
    assert run_all(eagle_runtime, prompts[:2], "eagle") == expected[:2]
    (stats,) = eagle_runtime.verifier_stats()
    assert stats["remote_drafting"]["failures"] >= 1
    assert stats["remote_drafting"]["reconnects"] >= 1


def test_cancel_frees_the_request(eagle_runtime, prompts) -> None:  # type: ignore[no-untyped-def]
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = eagle_runtime.submit(prompts[3], long, RequestSpec(method="eagle"))
    chunks = iter(stream)
    next(chunks)
    eagle_runtime.abort(stream)
    with pytest.raises((ray.exceptions.TaskCancelledError, StopIteration)):
        while True:
            next(chunks)
    # The engine keeps serving.
    short = SamplingParams(max_tokens=4, temperature=0)
    assert len([t for c in eagle_runtime.submit(prompts[1], short) for t in c]) == 4


def test_draft_model_pool_is_exact(prompts, expected) -> None:  # type: ignore[no-untyped-def]
    from cluster.runtime import Runtime

    runtime = Runtime.start(deployment("draft_model", drafters=1, draft_layers=8), num_cpus=2)
    try:
        assert run_all(runtime, prompts, "draft_model") == expected
        assert run_all(runtime, prompts[:1], "ngram") == expected[:1]  # in-verifier drafter
        (stats,) = runtime.verifier_stats()
        assert stats["spec"]["drafted"] > 0
    finally:
        runtime.shutdown()
