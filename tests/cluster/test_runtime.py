"""The disaggregated runtime on a real local Ray cluster: greedy output identical to plain
decoding with the drafter pool in its own actors (features over gloo links), a drafter killed
mid-stream, cancellation, and placement by resources on a simulated multi-node cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cluster.actors import info_when_up
from router.redis_server import free_port
from tests.cluster.common import GREEDY, deployment, run_all, stream_failures, wait_restarted
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eagle_runtime() -> Iterator[object]:
    from cluster.runtime import Runtime

    # The actors export their metrics every second (Ray's default: 10 s), for the scrape below.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_metrics_report_interval_ms", "1000")
        # EAGLE's drafter actors draft trees (every step, k fixed) for the requests that may
        # have them; structured output and predicted outputs draft chains.
        config = deployment("eagle", drafters=2, prefill=1, tree_nodes=8)
        runtime = Runtime.start(config, num_cpus=4)
    yield runtime
    runtime.shutdown()


def test_eagle_pool_with_remote_prefill_is_exact_and_drafts(
    eagle_runtime, prompts, expected
) -> None:  # type: ignore[no-untyped-def]
    """Every prompt prefills on the prefill worker (K/V into the verifier's blocks, hidden
    states on to the EAGLE drafters), draft trees come from two drafter actors."""
    assert run_all(eagle_runtime, prompts, "eagle") == expected
    (stats,) = eagle_runtime.verifier_stats()
    assert stats["spec"]["accepted"] > 0  # drafts came back from the drafter actors and held
    remote = stats["remote_drafting"]
    assert remote["feature_bytes"] > 0 and remote["failures"] == 0 and remote["trees"] > 0
    assert remote["wait_s"] > 0 and remote["handled_s"] >= remote["draft_s"] > 0
    steps = stats["steps"]
    # Engine steps, batched: fewer than the sequences' verify steps.
    assert steps["steps"] > 0 and steps["forward_s"] > 0
    assert 0 < steps["verify_steps"] <= steps["steps"]  # the steps that verified drafts
    assert 0 < steps["verify_forward_s"] <= steps["forward_s"]
    assert steps["draft_s"] >= remote["wait_s"]  # the engine's drafting wait holds the replies'
    assert stats["prefill"]["remote"] == len(prompts) and stats["prefill"]["failures"] == 0
    assert stats["drafter_failures"] == {}  # the remote drafters answered every call
    assert stats["prefill"]["bytes"] > 0
    info = eagle_runtime.actor_info()
    assert [d["name"] for d in info["drafters"]] == ["drafter-0", "drafter-1"]
    assert [p["name"] for p in info["prefill"]] == ["prefill-0"]
    stream = eagle_runtime.submit(prompts[1], GREEDY, RequestSpec(method="eagle"))
    assert [t for c in stream for t in c] == expected[1]
    assert stream.served_by.prefill == "prefill-0"
    assert stream.served_by.verifier == ["verifier-g0-r0"]
    assert stream.served_by.drafter in ("drafter-0", "drafter-1")
    assert {d["pid"] for d in info["drafters"]}.isdisjoint({v["pid"] for v in info["verifiers"]})


def test_structured_output_with_eagle_drafter_actors_is_exact(  # type: ignore[no-untyped-def]
    eagle_runtime, model_fp32, checkpoint
) -> None:
    """A JSON schema crosses to the verifier (which masks) and to the drafter actors (whose
    EAGLE drafts follow it, drafting ahead included): the output is plain decoding's under
    the same grammar, and drafts were accepted."""
    import json

    from tests.model.helpers import NAME_AND_AGE, PERSON_QUESTION
    from workers.engine.sequential import SequentialEngine
    from workers.engine.structured import compile_grammar

    tok = checkpoint.tokenizer
    schema, text = NAME_AND_AGE, PERSON_QUESTION
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    params = SamplingParams(
        max_tokens=40, temperature=0, structured=compile_grammar("json", schema)
    )
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=512, tokenizer=tok
    ).generate(prompt, params)
    (before,) = eagle_runtime.verifier_stats()
    stream = eagle_runtime.submit(prompt, params, RequestSpec(method="eagle"))
    got = [t for chunk in stream for t in chunk]
    assert got == plain.token_ids
    assert set(json.loads(tok.decode(got))) == {"name", "age"}
    (after,) = eagle_runtime.verifier_stats()
    assert after["spec"]["accepted"] > before["spec"]["accepted"]


def test_a_predicted_output_reaches_the_drafter_actors(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    """A request's predicted output crosses to the EAGLE drafter actors with its settings:
    they draft it, so nearly every draft holds, and the output is plain decoding's."""
    (before,) = eagle_runtime.verifier_stats()
    params = replace(GREEDY, prediction=tuple(expected[1]))
    stream = eagle_runtime.submit(prompts[1], params, RequestSpec(method="eagle"))
    assert [t for chunk in stream for t in chunk] == expected[1]
    (after,) = eagle_runtime.verifier_stats()
    drafted = after["spec"]["drafted"] - before["spec"]["drafted"]
    accepted = after["spec"]["accepted"] - before["spec"]["accepted"]
    assert drafted > 0 and accepted >= 0.8 * drafted


def test_logprobs_from_the_prefill_worker_and_the_verifier(  # type: ignore[no-untyped-def]
    eagle_runtime, model_fp32, checkpoint, prompts
) -> None:
    """The first token is drawn from the logits the prefill worker sent, the rest from the
    verifier's forwards over EAGLE drafts: each step's output has one log-probability per new
    token, and all are those of the in-process engine without speculation."""
    from workers.engine.config import EngineConfig
    from workers.engine.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2)
    stream = eagle_runtime.submit(prompts[2], params, RequestSpec(method="eagle"))
    outputs = list(stream.outputs())
    assert stream.served_by.prefill == "prefill-0"
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in outputs)
    got = [lp for o in outputs for lp in o.logprobs]
    plain = LLMEngine(
        model_fp32, EngineConfig(max_model_len=512), eos_token_ids=checkpoint.config.eos_token_ids
    ).generate([prompts[2]], params)[0]
    assert [lp.token_id for lp in got] == plain.token_ids
    assert [lp.logprob for lp in got] == pytest.approx(
        [lp.logprob for lp in plain.logprobs], abs=1e-4
    )
    assert [[i for i, _ in lp.top] for lp in got] == [
        [i for i, _ in lp.top] for lp in plain.logprobs
    ]


def test_a_span_per_request_and_round_across_ray_calls(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    from cluster import telemetry

    stream = eagle_runtime.submit(prompts[0], GREEDY, RequestSpec(method="eagle"))
    assert [t for chunk in stream for t in chunk] == expected[0]
    (request,) = [
        s
        for s in telemetry.finished_spans()
        if s["name"] == "outrider.request"
        and s["attributes"]["outrider.request_id"] == stream.request_id
    ]
    assert request["attributes"]["outrider.output_tokens"] == len(expected[0])
    spans = ray.get(eagle_runtime.pools.verifiers[0].finished_spans.remote())
    mine = [s for s in spans if s["attributes"].get("outrider.request_id") == stream.request_id]
    assert mine and all(
        s["trace_id"] == request["trace_id"] and s["parent_id"] == request["span_id"] for s in mine
    )
    # The prefill worker computed the whole prompt: the verifier ran no prompt token itself.
    assert not [s for s in mine if s["name"] == "outrider.prefill"]
    (transfer,) = [s for s in mine if s["name"] == "outrider.kv_transfer"]
    assert transfer["attributes"]["outrider.bytes_moved"] > 0
    rounds = [s for s in mine if s["name"] == "outrider.verify_round"]
    assert len(rounds) >= 2
    keys = {"outrider.spec.method", "outrider.spec.k", "outrider.spec.accepted"}
    keys |= {"outrider.draft_s", "outrider.verify_s", "outrider.bytes_moved"}
    assert all(keys <= set(s["attributes"]) for s in rounds)
    assert {s["attributes"]["outrider.spec.method"] for s in rounds} == {"eagle"}
    assert sum(s["attributes"]["outrider.spec.accepted"] for s in rounds) > 0
    assert sum(s["attributes"]["outrider.bytes_moved"] for s in mine) > 0


def test_killing_a_drafter_mid_stream_keeps_the_output(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    stream = eagle_runtime.submit(prompts[0], GREEDY, RequestSpec(method="eagle"))
    chunks = iter(stream)
    tokens = list(next(chunks))
    for actor in eagle_runtime.pools.drafters:
        ray.kill(actor, no_restart=False)  # Ray restarts them empty
    for chunk in chunks:
        tokens += chunk
    assert tokens == expected[0]
    assert stream.finish_reason == "length"
    # Later requests draft again once the drafters are back: the verifier reconnects on a
    # thread of its own (never its engine's), so a step or two after they answer.
    for actor in eagle_runtime.pools.drafters:
        info_when_up(actor, 120.0)
    deadline = time.monotonic() + 60
    while True:
        assert run_all(eagle_runtime, prompts[:2], "eagle") == expected[:2]
        (stats,) = eagle_runtime.verifier_stats()
        if stats["remote_drafting"]["reconnects"] >= 1 or time.monotonic() > deadline:
            break
    assert stats["remote_drafting"]["failures"] >= 1
    assert stats["remote_drafting"]["reconnects"] >= 1


def test_a_prompt_past_the_context_is_rejected_without_asking_the_prefill_worker(
    eagle_runtime, prompts
) -> None:  # type: ignore[no-untyped-def]
    (before,) = eagle_runtime.verifier_stats()
    too_long = prompts[0] * (4096 // len(prompts[0]) + 1)
    with pytest.raises((ValueError, ray.exceptions.RayTaskError), match="the context holds 4096"):
        for _ in eagle_runtime.submit(too_long, GREEDY, RequestSpec(method="eagle")):
            pass
    (after,) = eagle_runtime.verifier_stats()
    assert after["prefill"] == before["prefill"]  # no remote prefill tried, none failed


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


class _Unreachable:
    """A verifier handle whose output server cannot be reached (a firewall between the hosts):
    the client's stream falls back to a Ray streaming call."""

    def __init__(self, verifier: object) -> None:
        self._verifier = verifier

    def __getattr__(self, name: str) -> object:
        if name == "outputs_address":
            port = free_port()  # nobody listens there: a connection is refused
            return type("Method", (), {"remote": lambda _: ray.put(("127.0.0.1", port, b""))})()
        return getattr(self._verifier, name)


@pytest.mark.parametrize("transport", ["connection", "ray stream"])
def test_a_client_whose_output_stream_ends_has_its_requests_aborted(  # type: ignore[no-untyped-def]
    eagle_runtime, prompts, transport
) -> None:
    """A client's requests on a verifier share its output channel (cluster/output_channel.py),
    a connection of its own or, where the verifier cannot be reached, a Ray stream: their
    outputs come over it, and when it ends (the client closed it, or is gone) the verifier
    aborts them all and frees their blocks, and other clients' requests go on."""
    import asyncio

    from cluster.output_channel import StreamedStep
    from cluster.output_reader import GroupOutputs

    verifier = eagle_runtime.pools.verifiers[0]
    handle = verifier if transport == "connection" else _Unreachable(verifier)
    channel = GroupOutputs(handle, "leaving-client")
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    inboxes = []
    for i, prompt in enumerate(prompts[:2]):
        request_id = f"leaving-{i}"
        inboxes.append(channel.register(request_id))
        spec = RequestSpec(method="eagle")
        ray.get(verifier.start.remote(request_id, prompt, long, spec, channel.client))
    stays = eagle_runtime.submit(prompts[2], GREEDY, RequestSpec(method="eagle"))
    for inbox in inboxes:  # both decode
        assert isinstance(asyncio.run(inbox.get_async()), StreamedStep)
    assert channel.transport == transport
    channel.close()
    deadline = time.monotonic() + 5  # 800 tokens to go, were they not aborted
    while ray.get(verifier.load.remote()).running > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len([t for chunk in stays for t in chunk]) == GREEDY.max_tokens
    load = ray.get(verifier.load.remote())
    assert load.running == 0 and load.waiting == 0


def test_a_prefill_worker_that_dies_costs_no_request(  # type: ignore[no-untyped-def]
    eagle_runtime, model_fp32, checkpoint
) -> None:
    """A request that finds the prefill worker gone (dead, or restarting: Ray fails calls to a
    restarting actor at once) prefills on the verifier instead, with the same output; once Ray
    has restarted the worker, the next request rebuilds the link and prefills there again.
    New prompts: one the verifier's prefix cache holds whole would not go to the worker."""
    from workers.engine.sequential import SequentialEngine

    texts = [
        "The tallest volcano in the solar system is",
        "A short poem about the sea:\n",
        "Three facts about owls:",
    ]
    fresh = [checkpoint.tokenizer.encode(t) for t in texts]
    plain = SequentialEngine(model_fp32, eos_token_ids=checkpoint.config.eos_token_ids)
    want = [plain.generate(p, GREEDY).token_ids for p in fresh]

    def served(i: int) -> str | None:
        stream = eagle_runtime.submit(fresh[i], GREEDY, RequestSpec(method="eagle"))
        assert [t for c in stream for t in c] == want[i]
        return stream.served_by.prefill

    assert served(0) == "prefill-0"  # the link is up
    (before,) = eagle_runtime.verifier_stats()
    (worker,) = eagle_runtime.pools.prefills
    ray.kill(worker, no_restart=False)
    assert served(1) is None  # prefilled on the verifier
    (mid,) = eagle_runtime.verifier_stats()
    assert mid["prefill"]["failures"] == before["prefill"]["failures"] + 1
    info_when_up(worker, 120.0)  # until Ray has the worker back (its model loaded)
    assert served(2) == "prefill-0"  # the restarted worker, over a new link
    (after,) = eagle_runtime.verifier_stats()
    assert after["prefill"]["remote"] == before["prefill"]["remote"] + 1


def test_a_verifier_that_dies_comes_back_to_its_pools(eagle_runtime, prompts, expected) -> None:  # type: ignore[no-untyped-def]
    """Ray restarts a verifier killed mid-stream (late in this module: it takes the verifier's
    counters and prefix cache with it). The stream fails with the actor (the router answers
    503); once it is back, requests are exact again, drafted by the same drafter actors (which
    dropped the dead verifier's sequences) and prefilled by the same worker. Then the verifier
    and its drafters all at once."""
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = eagle_runtime.submit(prompts[3], long, RequestSpec(method="eagle"))
    chunks = iter(stream)
    received = 0
    while received < 16:  # past its first token (sampled from the prefill): drafted for
        received += len(next(chunks))
    (verifier,) = eagle_runtime.pools.verifiers
    before = ray.get(verifier.info.remote())["pid"]
    ray.kill(verifier, no_restart=False)
    with pytest.raises(stream_failures()):
        for _ in chunks:
            pass
    wait_restarted(verifier, before)
    assert run_all(eagle_runtime, prompts, "eagle") == expected
    (stats,) = eagle_runtime.verifier_stats()
    assert stats["spec"]["accepted"] > 0 and stats["remote_drafting"]["failures"] == 0
    assert stats["prefill"]["remote"] == len(prompts) and stats["prefill"]["failures"] == 0
    # A drafter hears of a finished sequence with the verifier's next step to it: after one
    # more request, only that request's own sequence is left, on its drafter.
    flush = eagle_runtime.submit(prompts[1], GREEDY, RequestSpec(method="eagle"))
    assert [t for c in flush for t in c] == expected[1]
    held = {d["name"]: d["sequences"] for d in eagle_runtime.actor_info()["drafters"]}
    assert held == {name: int(name == flush.served_by.drafter) for name in held}
    # A node lost with the verifier and its drafters on it: all restart at once, and the
    # verifier's constructor waits for drafters that are still loading.
    before = ray.get(verifier.info.remote())["pid"]
    for actor in [*eagle_runtime.pools.drafters, verifier]:
        ray.kill(actor, no_restart=False)
    wait_restarted(verifier, before)
    assert run_all(eagle_runtime, prompts[:2], "eagle") == expected[:2]
    (stats,) = eagle_runtime.verifier_stats()
    assert stats["spec"]["accepted"] > 0 and stats["remote_drafting"]["failures"] == 0


# Engine metrics that must have grown (or, for gauges, been seen above zero) by the end of the
# scrape below, by pool: the work of this module touched each. Rare events (preemptions, late
# drafts) are checked against the engine in tests/unit/test_engine_metrics.py.
WORKED = {
    "verifier": [
        "ray_outrider_engine_step_seconds_count",
        "ray_outrider_engine_forward_seconds_sum",
        "ray_outrider_engine_draft_seconds_count",
        "ray_outrider_engine_batch_size_count",
        "ray_outrider_engine_step_tokens_sum",
        "ray_outrider_spec_decode_num_drafts_total",
        "ray_outrider_spec_decode_num_draft_tokens_total",
        "ray_outrider_spec_decode_num_accepted_tokens_total",
        "ray_outrider_spec_decode_num_accepted_tokens_per_pos_total",
        "ray_outrider_spec_decode_acceptance_length_sum",
        "ray_outrider_spec_decode_k",
        "ray_outrider_drafter_feature_bytes_total",
        "ray_outrider_kv_cache_blocks_used",
        "ray_outrider_kv_cache_blocks_free",
        "ray_outrider_num_requests_running",
        "ray_outrider_remote_prefill_requests_total",
        "ray_outrider_actor_restarts_total",
    ],
    "drafter": [
        "ray_outrider_drafter_step_seconds_count",
        "ray_outrider_drafter_draft_seconds_sum",
        "ray_outrider_drafter_proposed_tokens_total",
        "ray_outrider_drafter_feature_bytes_received_total",
        "ray_outrider_drafter_sequences",
        "ray_outrider_actor_restarts_total",
    ],
    "prefill": [
        "ray_outrider_prefill_seconds_count",
        "ray_outrider_prefill_tokens_total",
        "ray_outrider_kv_transfer_bytes_total",
        "ray_outrider_kv_transfer_seconds_sum",
        "ray_outrider_actor_restarts_total",
    ],
}


def scrape_ray_metrics(url: str) -> dict[tuple[str, str], float]:
    """The largest value of each outrider series on a Ray metrics endpoint, by name and pool."""
    import re
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found: dict[tuple[str, str], float] = {}
    for name, labels, value in re.findall(r"^(ray_outrider_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        pool = re.search(r'pool="(\w+)"', labels)
        key = (name, pool.group(1) if pool else "")
        found[key] = max(found.get(key, 0.0), float(value))
    return found


def test_engine_metrics_reach_rays_prometheus_endpoint(eagle_runtime, prompts) -> None:  # type: ignore[no-untyped-def]
    """Last: the module's restarts are counted. While a generation runs, Ray's metrics endpoint
    (what the Ray dashboard and Prometheus read) shows each pool's metrics grown, and the KV
    blocks and running requests of the verifier above zero."""
    from cluster.engine_metrics import POOLS

    long = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    stream = eagle_runtime.submit(prompts[2], long, RequestSpec(method="eagle"))
    seen: dict[tuple[str, str], float] = {}
    url = eagle_runtime.metrics_url()  # what `outrider serve --cluster` prints
    last = 0.0
    for _ in stream:  # scrape while it generates
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            for key, value in scrape_ray_metrics(url).items():
                seen[key] = max(seen.get(key, 0.0), value)
    wanted = {(name, pool) for pool, names in WORKED.items() for name in names}
    deadline = time.monotonic() + 30
    while {k for k in wanted if seen.get(k, 0) <= 0} and time.monotonic() < deadline:
        time.sleep(1.0)
        for key, value in scrape_ray_metrics(url).items():
            seen[key] = max(seen.get(key, 0.0), value)
    assert sorted(k for k in wanted if seen.get(k, 0) <= 0) == []
    declared = {s for specs in POOLS.values() for spec in specs for s in spec.series()}
    assert {name for name, _ in seen} <= declared  # nothing exported that is not declared
