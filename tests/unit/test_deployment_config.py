"""The deployment config: YAML in, one typed object out, every error naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import (
    ConfigError,
    DeploymentConfig,
    from_dict,
    load_config,
    resolve_gpus,
    settings_differ,
)


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path: Path) -> None:
    config = DeploymentConfig()
    path = tmp_path / "deploy.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path) == config
    assert load_config(None) == config


def test_a_file_sets_nested_fields(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "dtype: float32\n"
        "pools:\n"
        "  verifier: {groups: 2, tensor_parallel_size: 4, resources: {gpus: 1}}\n"
        "  drafter: {replicas: 3, method: draft_model, draft_layers: 8,\n"
        "            resources: {cpus: 2, custom: {grace_cpu: 1}}}\n"
        "redis: {url: 'rediss://cache:6380/0', tls: true}\n"
    )
    config = load_config(path)
    assert config.dtype == "float32"
    assert (config.pools.verifier.groups, config.pools.verifier.tensor_parallel_size) == (2, 4)
    assert config.pools.verifier.resources.gpus == 1.0
    assert config.pools.drafter.resources.custom == {"grace_cpu": 1.0}
    assert config.pools.drafter.draft_layers == 8
    assert config.redis.tls


@pytest.mark.parametrize(
    ("cluster_gpus", "verifier", "prefill"),
    # With 7, the ranks do not fit and the prefill worker takes one (a CPU verifier still gets
    # prompts computed on a GPU).
    [(0, 0.0, 0.0), (7, 0.0, 1.0), (8, 1.0, 0.0), (9, 1.0, 1.0), (10, 1.0, 1.0)],
)
def test_pools_that_leave_gpus_null_take_one_each_where_the_cluster_has_enough(
    cluster_gpus: int, verifier: float, prefill: float
) -> None:
    """Eight verifier ranks claim first, then the prefill worker; drafters stay on CPUs."""
    pools = {"verifier": {"groups": 2, "tensor_parallel_size": 4}, "prefill": {"replicas": 1}}
    config = from_dict({"pools": pools})
    got = resolve_gpus(config, cluster_gpus).pools
    assert (got.verifier.resources.gpus, got.prefill.resources.gpus) == (verifier, prefill)
    assert got.drafter.resources.gpus == 0.0


def test_pools_that_name_their_gpus_claim_them_first() -> None:
    config = from_dict(
        {
            "pools": {
                "prefill": {"replicas": 2, "resources": {"gpus": 2}},  # 4 of the 8
                "verifier": {"tensor_parallel_size": 4},
                "drafter": {"replicas": 1, "resources": {"gpus": 0.5}},  # and half of one
            }
        }
    )
    pools = resolve_gpus(config, 8).pools
    assert pools.verifier.resources.gpus == 0.0  # 3.5 left for 4 ranks
    assert (pools.prefill.resources.gpus, pools.drafter.resources.gpus) == (2.0, 0.5)
    assert resolve_gpus(config, 8.5).pools.verifier.resources.gpus == 1.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"pools": {"verifier": {"tensor_parallel_size": 3}}},
            "pools.verifier.tensor_parallel_size",
        ),
        ({"pools": {"drafter": {"replicas": "two"}}}, "pools.drafter.replicas: must be an integer"),
        ({"pools": {"drafter": {"method": "medusa"}}}, "pools.drafter.method"),
        ({"dtype": "int4"}, "dtype"),
        ({"bogus": 1}, "config: unknown setting(s) bogus"),
        ({"pools": {"prefill": {"gpu": 1}}}, "pools.prefill: unknown setting(s) gpu"),
        ({"router": {"port": 70000}}, "router.port"),
        ({"router": {"grpc_port": 8000}}, "router.grpc_port: must differ"),
        ({"router": {"shutdown_grace_s": -1}}, "router.shutdown_grace_s: must be >= 0"),
        ({"redis": {"url": "http://redis"}}, "redis.url"),
        ({"pools": {"drafter": {"resources": {"custom": {"grace_cpu": 0}}}}}, "custom.grace_cpu"),
        ({"speculative": {"adaptive": "yes"}}, "speculative.adaptive: must be true or false"),
        (
            {"speculative": {"eagle_prompt_lookup": 1}},
            "speculative.eagle_prompt_lookup: must be true or false",
        ),
        ({"speculative": {"ngram_min": 0}}, "speculative.ngram_min: must be >= 1"),
        (
            {"speculative": {"ngram_min": 3, "ngram_max": 2}},
            "speculative.ngram_max: must be >= ngram_min (3)",
        ),
        (
            {"speculative": {"ngram_fallback_tokens": -1}},
            "speculative.ngram_fallback_tokens: must be >= 0",
        ),
        (
            {"speculative": {"min_draft_confidence": 1}},
            "speculative.min_draft_confidence: must be in [0, 1), got 1.0",
        ),
        (
            {"speculative": {"tree_nodes": 65}},
            "speculative.tree_nodes: must be in 0..64, got 65",
        ),
        ({"engine": []}, "engine: must be a mapping"),
        (
            {"engine": {"max_num_batched_tokens": 4}},
            "engine.max_num_batched_tokens: must fit one token plus",
        ),
        ({"telemetry": {"exporter": "jaeger"}}, "telemetry.exporter"),
        (
            {"router": {"deadlines": {"silent_after_s": 0}}},
            "router.deadlines.silent_after_s: must be > 0",
        ),
    ],
)
def test_bad_settings_name_the_field(raw: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert message in str(err.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listed)


def test_overrides_apply_dotted_keys_and_skip_unset_flags() -> None:
    config = from_dict({"dtype": "float32", "pools": {"drafter": {"replicas": 2}}})
    changed = config.with_overrides(
        {"pools.verifier.groups": 3, "dtype": None, "speculative.method": "ngram"}
    )
    assert changed.pools.verifier.groups == 3
    assert changed.dtype == "float32"  # None: the flag was not given
    assert changed.pools.drafter.replicas == 2
    off = config.with_overrides({"speculative.eagle_prompt_lookup": False})
    assert config.speculative.eagle_prompt_lookup and not off.speculative.eagle_prompt_lookup
    assert not off.engine_config().spec.eagle_prompt_lookup  # what verifiers and drafters build
    sure = config.with_overrides({"speculative.min_draft_confidence": 0.4})
    assert sure.engine_config().spec.min_draft_confidence == 0.4
    trees = config.with_overrides({"speculative.tree_nodes": 16})
    assert trees.engine_config().spec.tree_nodes == 16
    gpu = config.with_overrides(
        {
            "engine.max_num_batched_tokens": 2048,
            "engine.enforce_eager": True,
            "engine.deterministic": True,
            "engine.async_scheduling": True,
        }
    )
    assert gpu.engine_config().max_num_batched_tokens == 2048
    assert gpu.engine_config().enforce_eager and not config.engine_config().enforce_eager
    assert gpu.engine_config().deterministic and not config.engine_config().deterministic
    assert gpu.engine_config().async_scheduling and not config.engine_config().async_scheduling
    sizes = config.with_overrides({"speculative.ngram_min": 3, "speculative.ngram_max": 6})
    assert (sizes.engine_config().spec.ngram_min, sizes.engine_config().spec.ngram_max) == (3, 6)
    with pytest.raises(ConfigError, match=r"pools\.verifier\.gpus: no such setting"):
        config.with_overrides({"pools.verifier.gpus": 1})
    with pytest.raises(ConfigError, match=r"pools\.verifier\.groups"):
        config.with_overrides({"pools.verifier.groups": 0})


def test_pool_settings_differences_name_their_keys() -> None:
    """What a router that attaches to running pools checks: the pools' own settings only (not
    the router's), and a GPU count left to decide matches whatever it was decided to be."""
    wanted = from_dict({"router": {"max_queue": 8}})
    running = resolve_gpus(from_dict({}), cluster_gpus=2).pool_settings()
    assert running["pools"]["verifier"]["resources"]["gpus"] == 1  # decided at start
    assert settings_differ(wanted.pool_settings(), running) == []
    changed = wanted.with_overrides({"pools.drafter.replicas": 3, "dtype": "float32"})
    assert settings_differ(changed.pool_settings(), running) == ["dtype", "pools.drafter.replicas"]
    pinned = wanted.with_overrides({"pools.verifier.resources.gpus": 0})
    assert settings_differ(pinned.pool_settings(), running) == ["pools.verifier.resources.gpus"]


def test_flags_become_engine_settings_in_one_place() -> None:
    """`outrider` flags go through `deployment_of` for an engine in this process as for a
    cluster's actors; both build the engine from `DeploymentConfig.engine_config`."""
    from router.cli import deployment_of
    from router.cli_args import build_parser

    def config(*flags: str) -> Any:
        return deployment_of(build_parser().parse_args(["generate", "hi", *flags]))

    in_process = config()  # the fast path: bf16, a GGUF file's quantized blocks on CPUs
    assert (in_process.dtype, in_process.quantization) == ("bfloat16", "auto")
    assert in_process.speculative.method == "none"
    exact = config("--dtype", "float32", "--quantization", "none").model_spec()
    assert (exact.dtype, exact.quantization) == ("float32", "none")
    flags = ["--dtype", "bfloat16", "--spec-method", "ngram", "--num-spec-tokens", "6"]
    engine = config(*flags, "--max-num-seqs", "8", "--no-adaptive").engine_config()
    assert (engine.spec.method, engine.spec.num_speculative_tokens) == ("ngram", 6)
    assert engine.max_num_seqs == 8 and not engine.spec.adaptive
    assert config("--deterministic").engine_config().deterministic
    assert config("--async-scheduling").engine_config().async_scheduling
    assert not engine.deterministic
    assert config(*flags).dtype == "bfloat16"
    deployed = config("--cluster")  # a deployment's own defaults
    assert (deployed.dtype, deployed.speculative.method) == ("bfloat16", "eagle")
    assert deployed.engine_config() == from_dict({}).engine_config()


def test_a_one_host_cluster_gives_its_verifier_the_hosts_cores() -> None:
    """`--cluster` alone (what `make serve` runs): the verifier's torch threads are the host's
    cores, as an in-process engine's are, or `--threads`; a config file, a cluster to join or a
    tensor-parallel group keeps the pools' own CPUs, and refuses `--threads`."""
    import os

    from router.cli import deployment_of
    from router.cli_args import build_parser

    def verifier_cpus(*flags: str) -> float:
        args = build_parser().parse_args(["generate", "hi", "--cluster", *flags])
        return float(deployment_of(args).pools.verifier.resources.cpus)

    assert verifier_cpus() == (os.cpu_count() or 1)
    default = from_dict({}).pools.verifier.resources.cpus
    assert verifier_cpus("--address", "10.0.0.1:6379") == default
    assert verifier_cpus("--tp", "2") == default
    assert verifier_cpus("--threads", "1") == 1
    with pytest.raises(ValueError, match=r"pools\.verifier\.resources\.cpus"):
        verifier_cpus("--address", "10.0.0.1:6379", "--threads", "1")


def test_a_local_cluster_too_small_for_the_pools_fails_before_placement() -> None:
    """The bundles of every pool add up; a cluster short of any resource is refused at once,
    naming what it lacks, where waiting for placement could only time out."""
    from cluster.pools import PlacementError, check_fits, resources_needed

    config = from_dict(
        {
            "pools": {
                "verifier": {"groups": 2, "tensor_parallel_size": 2, "resources": {"cpus": 2}},
                "prefill": {"replicas": 1, "resources": {"gpus": 1}},
                "drafter": {"replicas": 2, "resources": {"custom": {"grace_cpu": 1}}},
            }
        }
    )
    needed = resources_needed(config)
    drafter_cpus = config.pools.drafter.resources.cpus
    prefill_cpus = config.pools.prefill.resources.cpus
    assert needed == {
        "CPU": 8 + prefill_cpus + 2 * drafter_cpus,
        "GPU": 1.0,
        "grace_cpu": 2.0,
    }
    check_fits(config, dict(needed))  # exactly enough
    with pytest.raises(PlacementError, match=r"grace_cpu 2 \(it has 1\)"):
        check_fits(config, {**needed, "grace_cpu": 1.0})
    with pytest.raises(PlacementError, match=r"GPU 1 \(it has 0\)"):
        check_fits(config, {"CPU": 64.0, "grace_cpu": 2.0})
