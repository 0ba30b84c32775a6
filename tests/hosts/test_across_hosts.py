"""The system served across six network hosts (tests/hosts/bed.py: a client, the router, Redis,
the Ray head, a verifier node, a drafter-and-prefill node), as the chart deploys it: the router
joins Ray through the head's client port, hidden states and KV blocks cross between the two
worker nodes over gloo links.

- 100 greedy requests, 16 at a time from the client host, each gives plain decoding's text.
- Every connection seen crossing hosts meanwhile is one the chart's NetworkPolicies allow, and
  every port they open for a named source was used by it (tests/hosts/policy.py).
- The drafter-and-prefill host cut off mid-stream: streams pause for less than
  `PAUSE_BOUND_S`, none fails, every text is plain decoding's, and drafting resumes once the
  host is back.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.common import TEXTS
from tests.hosts.bed import Bed, Load, Partition
from tests.hosts.policy import ROLE_OF_HOST, allowed, ingress_rules, pinned
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine

pytestmark = pytest.mark.slow

# The longest a stream can wait: a prompt whose turn on the prefill worker comes as its host is
# cut is given up after the deadline pools.prefill.timeout_s gives short prompts (3 s), and the
# prompts queued behind it with it; the verifier may then be in a step waiting out the silent
# drafter's deadline (1 s a step, LOST_AFTER_S in all) before it prefills them itself. The rest
# is the loaded 2-core VM's steps around them: 4.4-5.6 s in all were measured. What this
# catches is a pause of a deadline per step, or of a link's timeout (tens of seconds).
PAUSE_BOUND_S = 6.5
PROMPTS = [*TEXTS, "Three things to pack for a day in the mountains:"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(bed: Bed) -> Load:
    return bed.load(PROMPTS, requests=100, concurrency=16, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(model_fp32: Any, checkpoint: Any) -> list[str]:
    """Each prompt's text decoded by the model alone."""
    tok = checkpoint.tokenizer
    plain = SequentialEngine(model_fp32, eos_token_ids=checkpoint.config.eos_token_ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [tok.decode(plain.generate(tok.encode(p), params).token_ids) for p in PROMPTS]


def _check_texts(load: Load, expected: list[str]) -> None:
    failed = [(i, r["status"], r["error"]) for i, r in enumerate(load.rows) if r["status"] != "ok"]
    assert failed == []
    differing = [i for i, r in enumerate(load.rows) if r["text"] != expected[r["prompt"]]]
    assert differing == [], f"{len(differing)} of {len(load.rows)} differ: {differing[:5]}"


def test_a_hundred_requests_across_hosts_give_plain_decodings_text(
    served: Load, expected: list[str]
) -> None:
    _check_texts(served, expected)
    crossed = {(c.client, c.server) for c in served.connections}
    # The pools really are apart: the verifier's links to the drafter and the prefill worker,
    # and the router reaching Ray and Redis over the bridge.
    assert {("router", "head"), ("router", "redis")} <= crossed
    assert crossed & {("gpu", "cpu"), ("cpu", "gpu")}, crossed


def test_what_crosses_hosts_is_what_the_charts_network_policies_allow(served: Load) -> None:
    helm_python = pytest.importorskip("helm_python")
    from tests.helm.test_chart import CHART, render

    rules, selected = ingress_rules(render(helm_python.Chart.load(str(CHART)), {}))
    used = {(ROLE_OF_HOST[c.client], ROLE_OF_HOST[c.server], c.port) for c in served.connections}
    refused = sorted(u for u in used if not allowed(rules, selected, *u))
    assert refused == [], f"the chart's policies would drop these connections: {refused}"
    unused = sorted(pinned(rules) - used)
    assert unused == [], f"the chart opens ports nothing here used: {unused}"
    assert ("router", "ray", 10001) in used and ("ray", "ray") in {u[:2] for u in used}


def test_the_drafter_and_prefill_host_cut_off_mid_stream_costs_a_pause_not_a_request(
    bed: Bed,
    served: Load,  # the calm load first: the tests share the bed
    expected: list[str],
) -> None:
    """The `cpu` host (drafter and prefill worker) cut off for 10 s under 16 streams: the
    verifier gives up on the silent drafter within `LOST_AFTER_S` and on a prefill within
    `pools.prefill.timeout_s`, decodes and prefills alone meanwhile, and drafts again once the
    host is back. Every text is plain decoding's."""
    partition = Partition(bed.network, "cpu", at_s=3.0, down_s=10.0)
    during = bed.load(PROMPTS, requests=40, concurrency=16, max_tokens=MAX_TOKENS, during=partition)
    partition.mend()
    assert partition.cut_at is not None, "the load ended before the cut"
    _check_texts(during, expected)
    longest = max(r["longest_pause"] for r in during.rows)
    assert longest < PAUSE_BOUND_S, f"a stream paused {longest:.1f} s"
    deadline = time.monotonic() + 90
    while True:  # whole again: drafts come from the drafter once more
        after = bed.load(PROMPTS, requests=5, concurrency=5, max_tokens=MAX_TOKENS)
        _check_texts(after, expected)
        if any(r["drafted"] > 0 for r in after.rows) or time.monotonic() > deadline:
            break
    assert any(r["drafted"] > 0 for r in after.rows), "the drafter did not come back"
