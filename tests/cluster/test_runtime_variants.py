"""Runtime variants, each on its own Ray runtime: a draft-model pool drafting ahead, and a
tensor-parallel verifier group (TP = 2 over gloo)."""

from __future__ import annotations

import os

import pytest

from tests.cluster.common import GREEDY, deployment, run_all, stream_failures, wait_restarted
from workers.engine.config import RequestSpec

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("keep_going", [True, False])
def test_draft_model_pool_is_exact_and_drafts_ahead(  # type: ignore[no-untyped-def]
    prompts, expected, checkpoint, tmp_path, keep_going: bool
) -> None:
    """A copy of the target in its own model folder as the draft model: whole drafts are
    accepted, so the drafter's guesses while the verifier works come true and proposals are
    served from drafting ahead: most of them while it goes on (the default), or, with
    `keep_drafting_ahead: false`, by stopping it at each step and answering from the prepared
    draft. A draft model from its own file is all the drafter actor loads (the target's config
    aside). Without `keep_drafting_ahead` the server's default is n-gram, so the verifier links
    to the pool when the first request asks for it (`make serve`'s case)."""
    from cluster.runtime import Runtime
    from workers.model.loader import save_safetensors_dir

    save_safetensors_dir(checkpoint, tmp_path / "draft")
    config = deployment(
        "draft_model",
        drafters=1,
        draft_model=str(tmp_path / "draft"),
        keep_drafting_ahead=keep_going,
    )
    if not keep_going:
        config = config.with_overrides({"speculative.method": "ngram"})
    runtime = Runtime.start(config, num_cpus=2)
    try:
        assert run_all(runtime, prompts, "draft_model") == expected
        assert run_all(runtime, prompts[:1], "ngram") == expected[:1]  # in-verifier drafter
        (stats,) = runtime.verifier_stats()
        assert stats["spec"]["drafted"] > 0
        assert stats["remote_drafting"]["ahead_served"] > 0
        assert (stats["remote_drafting"]["ahead_kept_going"] > 0) == keep_going
        (drafter,) = runtime.actor_info()["drafters"]
        assert drafter["draft_ahead"] and drafter["token_seconds"] > 0
        assert drafter["keep_drafting_ahead"] == keep_going
    finally:
        runtime.shutdown()


def test_tensor_parallel_verifier_is_exact(prompts, expected) -> None:  # type: ignore[no-untyped-def]
    """TP = 2 over gloo (SmolLM2's 3 KV heads split 2 + 1), with a remote EAGLE drafter and
    every prompt prefilled by the prefill worker (rank 0 passes rank 1 its heads' K/V)."""
    from cluster.runtime import Runtime

    config = deployment("eagle", drafters=1, prefill=1).with_overrides(
        {"pools.verifier.tensor_parallel_size": 2}
    )
    runtime = Runtime.start(config, num_cpus=4)
    try:
        assert run_all(runtime, prompts, "eagle") == expected
        assert run_all(runtime, prompts[:2], "ngram") == expected[:2]
        info = runtime.actor_info()
        assert info["verifiers"][0]["ranks"] == ["verifier-g0-r1"]
        stream = runtime.submit(prompts[2], GREEDY, RequestSpec(method="eagle"))
        assert [t for c in stream for t in c] == expected[2]
        assert stream.served_by.verifier == ["verifier-g0-r0", "verifier-g0-r1"]
        assert stream.served_by.prefill == "prefill-0"
        (stats,) = runtime.verifier_stats()
        assert stats["spec"]["accepted"] > 0
        assert stats["prefill"]["remote"] == len(prompts) + 3 and stats["prefill"]["failures"] == 0
        # A rank that dies breaks the group: the next request fails with rank 0, which ends
        # itself; restarted, it restarts rank 1 and forms the group again.
        (verifier,), (rank,) = runtime.pools.verifiers, runtime.pools.ranks
        before = ray.get(verifier.info.remote())["pid"]
        ray.kill(rank, no_restart=False)
        with pytest.raises(stream_failures()):
            run_all(runtime, prompts[:1], "eagle")
        wait_restarted(verifier, before)
        assert run_all(runtime, prompts, "eagle") == expected
    finally:
        runtime.shutdown()


def test_a_users_drafter_serves_from_the_drafter_pool(  # type: ignore[no-untyped-def]
    prompts, expected, tmp_path, monkeypatch
) -> None:
    """docs/design.md's example drafter, installed where the actors import it (PYTHONPATH, as
    a user's package would be), as the drafter pool's method: output is plain decoding's and
    its drafts were taken."""
    from cluster.runtime import Runtime
    from tests.unit.test_user_drafter import EXAMPLE, docs_example

    (tmp_path / "outrider_example_drafters.py").write_text(docs_example())
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    runtime = Runtime.start(deployment(EXAMPLE, drafters=1), num_cpus=2)
    try:
        assert run_all(runtime, prompts, EXAMPLE) == expected
        (stats,) = runtime.verifier_stats()
        assert stats["spec"]["accepted"] > 0
    finally:
        runtime.shutdown()
