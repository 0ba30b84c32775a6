"""Actors land by resources: on a simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`)
where only one node has the `grace_cpu` resource, drafters that ask for it run there, and the
verifier runs elsewhere; asking for a resource no node has fails with a clear error."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from cluster.config import from_dict

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def multi_node() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    # Ray counts GPUs it is told of: the "GPU node" has two, with no CUDA behind them.
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"gpu_node": 1})
    grace = cluster.add_node(num_cpus=2, resources={"grace_cpu": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="outrider", log_to_driver=False)
    yield grace
    ray.shutdown()
    cluster.shutdown()


def test_drafters_land_on_the_grace_node(multi_node) -> None:  # type: ignore[no-untyped-def]
    from cluster.runtime import Runtime

    config = from_dict(
        {
            "dtype": "float32",
            "speculative": {"method": "ngram"},
            "pools": {
                "prefill": {"replicas": 0},
                "verifier": {"resources": {"cpus": 1, "custom": {"gpu_node": 1}}},
                "drafter": {
                    "replicas": 2,
                    "method": "ngram",
                    "resources": {"cpus": 1, "custom": {"grace_cpu": 1}},
                },
            },
        }
    )
    runtime = Runtime.start(config)
    try:
        info = runtime.actor_info()
        assert {d["node_id"] for d in info["drafters"]} == {multi_node.node_id}
        assert info["verifiers"][0]["node_id"] != multi_node.node_id
        # The verifier left `gpus` null and the cluster has two: it got one, the drafters none.
        # This torch has no CUDA, so every actor's models are on its CPU all the same.
        assert len(info["verifiers"][0]["gpu_ids"]) == 1
        assert all(d["gpu_ids"] == [] for d in info["drafters"])
        assert {a["device"] for pool in info.values() for a in pool} == {"cpu"}
    finally:
        runtime.shutdown()


def test_pools_left_to_decide_take_gpus_only_where_the_cluster_has_enough(
    multi_node,  # type: ignore[no-untyped-def]
) -> None:
    """Two GPUs: the verifier's rank and the prefill worker get one each (both land on the GPU
    node, with no custom resource asked for). How the cluster's GPUs are shared out when they
    do not cover every actor (ranks first, the prefill worker on CPUs) is `resolve_gpus`'s
    unit test (tests/unit/test_deployment_config.py); this checks the runtime asks the
    cluster and places by the answer."""
    from cluster.runtime import Runtime

    config = from_dict(
        {
            "dtype": "float32",
            "speculative": {"method": "ngram"},
            "pools": {
                "prefill": {"replicas": 1, "resources": {"cpus": 0.5}},
                "verifier": {"resources": {"cpus": 0.5}},
                "drafter": {"replicas": 0, "method": "ngram"},
            },
        }
    )
    assert config.pools.verifier.resources.gpus is None  # the default: decide at start
    runtime = Runtime.start(config)
    try:
        info, pools = runtime.actor_info(), runtime.config.pools
    finally:
        runtime.shutdown()
    (verifier,), (prefill,) = info["verifiers"], info["prefill"]
    assert len(verifier["gpu_ids"]) == len(prefill["gpu_ids"]) == 1
    assert verifier["node_id"] == prefill["node_id"] != multi_node.node_id
    assert pools.verifier.resources.gpus == pools.prefill.resources.gpus == 1.0


def test_an_actor_given_a_gpu_runs_its_models_there(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from cluster.actors import assigned_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])  # Ray's CUDA_VISIBLE_DEVICES=3
    assert assigned_device() == "cuda"
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert assigned_device() == "cpu"
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch
    assert assigned_device() == "cpu"


def test_unsatisfiable_placement_is_a_clear_error(multi_node) -> None:  # type: ignore[no-untyped-def]
    from cluster.pools import PlacementError
    from cluster.runtime import Runtime

    config = from_dict(
        {
            "pools": {
                "prefill": {"replicas": 0},
                "drafter": {"replicas": 1, "resources": {"custom": {"tpu_v9": 1}}},
            }
        }
    )
    with pytest.raises(PlacementError, match="tpu_v9"):
        Runtime.start(config, placement_timeout_s=3)


def test_pools_started_for_a_joined_cluster_outlive_the_router_that_started_them(
    multi_node,  # type: ignore[no-untyped-def]
    caplog,  # type: ignore[no-untyped-def]
) -> None:
    """A router replica that joined a cluster (an address) starts the pools as detached actors:
    its shutdown (a rollout replacing it) leaves them to the other replicas, which attach; one
    whose config asks for other pools says so."""
    from cluster.runtime import Runtime
    from workers.engine.sampling_params import SamplingParams

    config = from_dict(
        {
            "dtype": "float32",
            "speculative": {"method": "ngram"},
            "pools": {"prefill": {"replicas": 0}, "drafter": {"replicas": 0}},
        }
    )
    address = ray.get_runtime_context().gcs_address
    first = Runtime.start(config, address=address)
    try:
        assert first.pools.detached and not first.pools.attached
        first.shutdown()  # the replica goes; its pools stay
        other = Runtime.attach(config)
        assert other is not None and other.pools.attached
        assert other.pools.verifier_names == first.pools.verifier_names == ["verifier-g0-r0"]
        params = SamplingParams(max_tokens=5, temperature=0)
        assert len([t for chunk in other.submit([1, 2, 3], params) for t in chunk]) == 5
        other.shutdown()
        assert (
            ray.get(first.pools.verifiers[0].info.remote(), timeout=30)["name"] == "verifier-g0-r0"
        )
        assert "other settings" not in caplog.text
        changed = config.with_overrides({"engine.max_num_seqs": 4, "router.max_queue": 9})
        with caplog.at_level(logging.WARNING, logger="cluster.runtime"):
            assert Runtime.attach(changed) is not None
        assert "other settings (engine.max_num_seqs) than this config" in caplog.text
    finally:
        first.shutdown(stop_pools=True)
