"""The deployment config: one typed description of a running Outrider, from YAML and flags.

The same field names appear everywhere a deployment is described: this module (and the YAML
file `outrider serve --config` reads), the Helm chart (helm/outrider renders this file into a
ConfigMap from its values), and `outrider k8s` (which reads pool sizes back from the
RayCluster). A config is checked as a whole when it is built, and every error names the field:

    model: null                 # GGUF file, HF folder, fetched name, or null for the bundled model
    dtype: bfloat16
    quantization: auto          # none, gguf (a GGUF file's blocks), int8; auto: gguf on CPUs
    engine: {max_model_len: 4096, max_num_seqs: 32, block_size: 16, max_num_batched_tokens: 512}
    speculative: {method: eagle, num_speculative_tokens: 4, adaptive: true,
                  eagle_prompt_lookup: true,    # EAGLE copies where the text repeats
                  ngram_min: 2, ngram_max: 4,   # n-gram sizes prompt lookup matches
                  ngram_fallback_tokens: 8,     # draft after a 1-token match (ngram, suffix)
                  min_draft_confidence: 0.5,    # a model draft ends where the drafter doubts it
                  tree_nodes: 0}                # EAGLE trees of up to this many nodes (0: chains)
    pools:
      prefill:  {replicas: 1, resources: {cpus: 1, gpus: null}}   # null: a GPU each where
      verifier: {groups: 1, tensor_parallel_size: 1,              # the cluster has enough
                 resources: {cpus: 1, gpus: null}}                # at start, else CPUs
      drafter:  {replicas: 1, method: eagle, num_speculative_tokens: 4, draft_ahead: true,
                 keep_drafting_ahead: true,   # a draft model goes on across guessed steps
                 resources: {cpus: 1, custom: {grace_cpu: 1}}}
    router: {host: 0.0.0.0, port: 8000, grpc_port: 50051, max_queue: 256,
             requests_per_s: 0, burst: 0,                 # per-key token bucket, 0: none
             max_concurrent_per_key: 0, tokens_per_s: 0, token_burst: 0,   # per key, 0: none
             tls: {cert_file: null, key_file: null},   # both: HTTPS and gRPC over TLS only
             docs: true,              # false: no /docs, /redoc or /openapi.json
             shutdown_grace_s: 30,    # on SIGTERM, how long requests in flight may finish
             log_format: text,        # or json: a JSON object per log line (router and actors)
             migration: {max_wait_s: 90, max_attempts: 3},  # a failed group's requests go on
             deadlines: {silent_after_s: 5, answer_within_s: 2,   # a part that stops
                         hints_within_s: 0.25}}                  # answering is given up
    redis: {url: null, tls: false, password_env: null}   # url null: embedded redis-server
    telemetry: {otlp_endpoint: null, service_name: outrider}
    ray: {address: null, dashboard_host: 127.0.0.1, dashboard_port: 8265}
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.pool_settings import (
    ConfigError,
    DrafterPool,
    Pools,
    PrefillPool,
    Resources,
    VerifierPool,
)
from cluster.pool_settings import (
    check_field as _check,
)
from cluster.router_settings import (
    DeadlineSettings,
    MigrationSettings,
    RouterSettings,
    TlsSettings,
)
from workers.engine.config import (
    DEFAULT_MIN_DRAFT_CONFIDENCE,
    METHODS_HELP,
    EngineConfig,
    SpecConfig,
    valid_method,
)
from workers.model.config import QUANTIZATIONS

__all__ = [
    "ConfigError",
    "DeadlineSettings",
    "DeploymentConfig",
    "DrafterPool",
    "MigrationSettings",
    "Pools",
    "PrefillPool",
    "Resources",
    "RouterSettings",
    "TlsSettings",
    "VerifierPool",
]

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    max_model_len: int = 4096
    max_num_seqs: int = 32
    block_size: int = 16
    # Tokens a step may bring (prefill chunks, decode and draft tokens; on a GPU 2048, say).
    max_num_batched_tokens: int = 512
    # workers/engine/config.py EngineConfig says what these do.
    enforce_eager: bool = False
    deterministic: bool = False
    async_scheduling: bool = False
    # While several tenants (API keys) have requests, the most of a step's places one tenant's
    # may fill (workers/engine/fair_share.py); 1: no cap.
    max_step_share: float = 0.5


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    method: str = "eagle"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    eagle_prompt_lookup: bool = True  # EAGLE drafts by prompt lookup where the text repeats
    # The n-gram sizes prompt lookup matches (ngram and suffix drafting, and EAGLE's lookup):
    # the longest suffix of the text of ngram_max..ngram_min tokens that occurred before.
    ngram_min: int = 2
    ngram_max: int = 4
    # ngram and suffix drafting: where no such suffix occurred, the last token alone proposes
    # at most this many tokens (0: no fallback).
    ngram_fallback_tokens: int = 8
    # A model drafter ends a draft once its own probability of the draft so far falls below
    # this (0: it always drafts k).
    min_draft_confidence: float = DEFAULT_MIN_DRAFT_CONFIDENCE
    # EAGLE drafts trees of at most this many nodes where they pay more than a chain (0: chains).
    tree_nodes: int = 0


@dataclass(frozen=True, slots=True)
class RedisSettings:
    url: str | None = None  # None: an embedded redis-server child process
    tls: bool = False
    password_env: str | None = None  # environment variable holding the password (not the URL)

    def connection_url(self, url: str | None = None) -> str | None:
        """`url` (default: the configured one) with TLS on when asked for (rediss://)."""
        url = url or self.url
        if url is not None and self.tls and url.startswith("redis://"):
            return "rediss://" + url[len("redis://") :]
        return url

    def password(self) -> str | None:
        return os.environ.get(self.password_env) if self.password_env else None


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    otlp_endpoint: str | None = None  # e.g. http://otel-collector:4318 (OTLP/HTTP)
    service_name: str = "outrider"
    exporter: str = "none"  # without otlp_endpoint: none, console, or memory (tests)


@dataclass(frozen=True, slots=True)
class RaySettings:
    address: str | None = None  # None: start a local cluster; "auto" or host:port to join
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    model: str | None = None
    dtype: str = "bfloat16"
    quantization: str = "auto"
    engine: EngineSettings = field(default_factory=EngineSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    pools: Pools = field(default_factory=Pools)
    router: RouterSettings = field(default_factory=RouterSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    ray: RaySettings = field(default_factory=RaySettings)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        _check(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {', '.join(QUANTIZATIONS)}",
        )
        e = self.engine
        for name in ("max_model_len", "max_num_seqs", "block_size", "max_num_batched_tokens"):
            _check(getattr(e, name) >= 1, f"engine.{name}", "must be >= 1")
        _check(
            0 < e.max_step_share <= 1,
            "engine.max_step_share",
            f"must be in (0, 1], got {e.max_step_share}",
        )
        _check(
            e.max_num_batched_tokens >= 1 + self.speculative.num_speculative_tokens,
            "engine.max_num_batched_tokens",
            "must fit one token plus speculative.num_speculative_tokens drafts",
        )
        for where, method, k in (
            ("speculative", self.speculative.method, self.speculative.num_speculative_tokens),
            ("pools.drafter", self.pools.drafter.method, self.pools.drafter.num_speculative_tokens),
        ):
            _check(valid_method(method), f"{where}.method", f"must be {METHODS_HELP}")
            _check(0 <= k <= 16, f"{where}.num_speculative_tokens", f"must be in 0..16, got {k}")
        s = self.speculative
        _check(s.ngram_min >= 1, "speculative.ngram_min", f"must be >= 1, got {s.ngram_min}")
        _check(
            s.ngram_max >= s.ngram_min,
            "speculative.ngram_max",
            f"must be >= ngram_min ({s.ngram_min}), got {s.ngram_max}",
        )
        _check(
            s.ngram_fallback_tokens >= 0,
            "speculative.ngram_fallback_tokens",
            f"must be >= 0, got {s.ngram_fallback_tokens}",
        )
        _check(
            0.0 <= s.min_draft_confidence < 1.0,
            "speculative.min_draft_confidence",
            f"must be in [0, 1), got {s.min_draft_confidence}",
        )
        _check(
            0 <= s.tree_nodes <= 64,
            "speculative.tree_nodes",
            f"must be in 0..64, got {s.tree_nodes}",
        )
        p = self.pools
        _check(p.prefill.replicas >= 0, "pools.prefill.replicas", "must be >= 0")
        _check(
            p.prefill.min_remote_prompt_tokens >= 0,
            "pools.prefill.min_remote_prompt_tokens",
            "must be >= 0",
        )
        for name in ("timeout_s", "min_tokens_per_s", "retry_after_s"):
            value = getattr(p.prefill, name)
            _check(value > 0, f"pools.prefill.{name}", f"must be positive, got {value}")
        _check(p.verifier.groups >= 1, "pools.verifier.groups", "must be >= 1")
        tp = p.verifier.tensor_parallel_size
        _check(
            tp >= 1 and tp & (tp - 1) == 0,
            "pools.verifier.tensor_parallel_size",
            f"must be a power of two, got {tp}",
        )
        _check(p.drafter.replicas >= 0, "pools.drafter.replicas", "must be >= 0")
        _check(
            p.drafter.draft_layers is None or p.drafter.draft_layers >= 1,
            "pools.drafter.draft_layers",
            "must be >= 1",
        )
        for name in ("prefill", "verifier", "drafter"):
            getattr(p, name).resources.validate(f"pools.{name}.resources")
        for where, port in (
            ("router.port", self.router.port),
            ("router.grpc_port", self.router.grpc_port),
            ("ray.dashboard_port", self.ray.dashboard_port),
        ):
            _check(0 < port < 65536, where, f"must be a TCP port, got {port}")
        _check(
            self.router.port != self.router.grpc_port,
            "router.grpc_port",
            "must differ from router.port",
        )
        _check(self.router.max_queue >= 1, "router.max_queue", "must be >= 1")
        per_key = ("requests_per_s", "burst", "max_concurrent_per_key")
        for name in (*per_key, "tokens_per_s", "token_burst"):
            _check(getattr(self.router, name) >= 0, f"router.{name}", "must be >= 0")
        tls = self.router.tls
        _check(
            (tls.cert_file is None) == (tls.key_file is None),
            "router.tls",
            "cert_file and key_file go together",
        )
        _check(self.router.shutdown_grace_s >= 0, "router.shutdown_grace_s", "must be >= 0")
        migration = self.router.migration
        _check(migration.max_wait_s >= 0, "router.migration.max_wait_s", "must be >= 0")
        _check(migration.max_attempts >= 0, "router.migration.max_attempts", "must be >= 0")
        for name, value in dataclasses.asdict(self.router.deadlines).items():
            _check(value > 0, f"router.deadlines.{name}", "must be > 0")
        _check(
            self.router.log_format in ("text", "json"),
            "router.log_format",
            "must be text or json",
        )
        _check(
            self.telemetry.exporter in ("none", "console", "memory"),
            "telemetry.exporter",
            "must be none, console or memory (set otlp_endpoint for OTLP)",
        )
        if self.redis.url is not None:
            _check(
                self.redis.url.startswith(("redis://", "rediss://", "unix://")),
                "redis.url",
                "must start with redis://, rediss:// or unix://",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def pool_settings(self) -> dict[str, Any]:
        """What the pools' actors are built from (the rest configures routers and clients)."""
        raw = self.to_dict()
        keys = ("model", "dtype", "quantization", "engine", "speculative", "pools")
        return {key: raw[key] for key in keys}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def engine_config(self) -> EngineConfig:
        """The engine settings of this deployment: the one place a config (file, flags, Helm
        values) becomes what an engine is built with, in-process or in a pool's actor."""
        s = self.speculative
        spec = SpecConfig(
            method=s.method,
            num_speculative_tokens=s.num_speculative_tokens,
            adaptive=s.adaptive,
            eagle_prompt_lookup=s.eagle_prompt_lookup,
            ngram_min=s.ngram_min,
            ngram_max=s.ngram_max,
            ngram_fallback_tokens=s.ngram_fallback_tokens,
            min_draft_confidence=s.min_draft_confidence,
            tree_nodes=s.tree_nodes,
        )
        e = self.engine
        return EngineConfig(
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            block_size=e.block_size,
            max_num_batched_tokens=e.max_num_batched_tokens,
            enforce_eager=e.enforce_eager,
            deterministic=e.deterministic,
            async_scheduling=e.async_scheduling,
            max_step_share=e.max_step_share,
            spec=spec,
        )

    def model_spec(self, device: str = "cpu") -> Any:
        """The models to load (a `ModelSpec`): the target, and the drafter pool's draft model
        or EAGLE head."""
        from workers.eagle.layout import is_eagle3_folder
        from workers.engine.factory import ModelSpec

        drafter = self.pools.drafter
        draft_model, eagle_head = drafter.draft_model, drafter.eagle_head
        if draft_model is not None and is_eagle3_folder(Path(draft_model)):
            draft_model, eagle_head = None, eagle_head or draft_model
        # Every pool holds the weights as the verifiers do (`quantization: auto` decided by
        # their device): a prefill worker's KV cache must be what the verifier would compute.
        verifier_device = "cuda" if self.pools.verifier.resources.gpus else "cpu"
        return ModelSpec(
            self.model,
            self.dtype,
            draft_model,
            drafter.draft_layers,
            eagle_head,
            device,
            self.quantization,
            verifier_device if self.pools.verifier.resources.gpus is not None else None,
        )

    def with_overrides(self, overrides: dict[str, Any]) -> DeploymentConfig:
        """A copy with dotted keys replaced (`{"pools.verifier.tensor_parallel_size": 2}`);
        None values are skipped, so unset CLI flags leave the file's values alone."""
        raw = self.to_dict()
        for dotted, value in overrides.items():
            if value is None:
                continue
            node = raw
            *parents, last = dotted.split(".")
            for key in parents:
                _check(isinstance(node.get(key), dict), dotted, "no such setting")
                node = node[key]
            _check(last in node, dotted, "no such setting")
            node[last] = value
        return from_dict(raw)


def settings_differ(wanted: Any, running: Any, where: str = "") -> list[str]:
    """Dotted keys where `running` pool settings are not `wanted` (both `pool_settings()`); a
    pool's GPUs that `wanted` leaves to decide (null) match what they were decided to be."""
    if isinstance(wanted, dict) and isinstance(running, dict):
        return [
            difference
            for key in sorted(wanted.keys() | running.keys())
            for difference in settings_differ(
                wanted.get(key), running.get(key), f"{where}.{key}" if where else key
            )
        ]
    if wanted is None and where.endswith(".resources.gpus"):
        return []
    return [] if wanted == running else [where]


def resolve_gpus(config: DeploymentConfig, cluster_gpus: float) -> DeploymentConfig:
    """`config` with every pool's `gpus: null` decided. Verifier ranks, then prefill workers,
    get one GPU per actor where the cluster's GPUs that no pool has claimed yet (pools that name
    their GPUs claim first) cover all of the pool's actors, and none otherwise (the pool runs
    on CPUs). Drafters get none: they are placed by CPUs and custom resources."""
    pools = config.pools
    actors = {
        "verifier": pools.verifier.groups * pools.verifier.tensor_parallel_size,
        "prefill": pools.prefill.replicas,
        "drafter": pools.drafter.replicas,
    }
    gpus = {name: getattr(pools, name).resources.gpus for name in actors}
    free = cluster_gpus - sum(actors[n] * g for n, g in gpus.items() if g is not None)
    overrides: dict[str, Any] = {}
    for name in ("verifier", "prefill", "drafter"):
        if gpus[name] is None:
            take = name != "drafter" and 0 < actors[name] <= free
            free -= actors[name] if take else 0
            overrides[f"pools.{name}.resources.gpus"] = 1.0 if take else 0.0
    return config.with_overrides(overrides)


def from_dict(raw: dict[str, Any] | None) -> DeploymentConfig:
    """Build and validate a config from plain data (parsed YAML); unknown keys are errors."""
    return _build(DeploymentConfig, raw or {}, "")


def load_config(path: str | Path | None = None) -> DeploymentConfig:
    """The config in a YAML file, or the defaults without one."""
    if path is None:
        return DeploymentConfig()
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    _check(raw is None or isinstance(raw, dict), str(path), "must hold a mapping")
    return from_dict(raw)


def _build(cls: type, raw: Any, where: str) -> Any:
    _check(isinstance(raw, dict), where or "config", f"must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    _check(not unknown, where or "config", f"unknown setting(s) {', '.join(unknown)}")
    prefix = f"{where}." if where else ""
    return cls(**{name: _value(hints[name], raw[name], prefix + name) for name in raw})


def _value(hint: Any, raw: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, raw, where)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if raw is None:
            _check(type(None) in args, where, "must not be null")
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, raw, where)
    if origin is dict:
        _check(isinstance(raw, dict), where, "must be a mapping")
        return {str(k): _value(args[1], v, f"{where}.{k}") for k, v in raw.items()}
    if hint is bool:
        _check(isinstance(raw, bool), where, f"must be true or false, got {raw!r}")
        return raw
    if hint is int:
        _check(
            isinstance(raw, int) and not isinstance(raw, bool),
            where,
            f"must be an integer, got {raw!r}",
        )
        return raw
    if hint is float:
        _check(
            isinstance(raw, int | float) and not isinstance(raw, bool),
            where,
            f"must be a number, got {raw!r}",
        )
        return float(raw)
    if hint is str:
        _check(isinstance(raw, str), where, f"must be a string, got {raw!r}")
        return raw
    raise ConfigError(f"{where}: unsupported setting type {hint!r}")  # a bug in this module
