"""The router's part of the deployment config (cluster/config.py checks it with the rest):
where it listens, its admission and per-key limits, TLS, how it migrates requests, and how long
it waits on a part that stopped answering."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    """A request whose verifier group fails mid-way (its actor dies, a rank of it restarts)
    goes on from its committed tokens on a healthy group, or on the same one once it is back
    (router/service.py): within `max_wait_s` of each failure, at most `max_attempts` times a
    request; past either, the client gets the 503 as before. 0 attempts: never migrate."""

    max_wait_s: float = 90.0
    max_attempts: int = 3


@dataclass(frozen=True, slots=True)
class DeadlineSettings:
    """How long a router waits on a part that may have stopped answering (its host cut off:
    packets dropped, nothing closed) before it goes on without it (docs/operations.md,
    Failures)."""

    # A verifier group with requests waiting that does not answer the router's keep-alive
    # within this is given up as a dead one would be: its requests move to another group.
    silent_after_s: float = 5.0
    # A group's load or health not back within this: routing and /ready take it for down.
    answer_within_s: float = 2.0
    # Redis's prefix hints not back within this: the request is routed by load.
    hints_within_s: float = 0.25


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """PEM certificate and key files (a cert-manager Secret's tls.crt and tls.key): both given,
    the HTTP and gRPC APIs speak TLS only, and pick up renewed files (router/tls.py)."""

    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class RouterSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051
    max_queue: int = 256  # admitted but unfinished requests before 503
    # Every API key's limits unless its line in the keys file says otherwise (router/keys.py);
    # 0: no limit. Requests per second and the bucket's size (0: one second's worth):
    requests_per_s: float = 0.0
    burst: int = 0
    max_concurrent_per_key: int = 0  # a key's unfinished requests on one replica, 429 beyond
    # Prompt plus max_tokens of each request, from a bucket shared by the replicas (what a
    # request did not use is given back); the bucket's size (0: a minute's worth).
    tokens_per_s: float = 0.0
    token_burst: int = 0
    tls: TlsSettings = field(default_factory=TlsSettings)
    docs: bool = True  # the OpenAPI document and its pages (/docs, /redoc, /openapi.json)
    # On SIGTERM (or SIGINT), how long the requests in flight may run before they are cut; new
    # ones are refused meanwhile (router/server.py `Router.drain`).
    shutdown_grace_s: float = 30.0
    # How the router and the pools' actors log (cluster/logs.py): text, or json (a line each).
    log_format: str = "text"
    migration: MigrationSettings = field(default_factory=MigrationSettings)
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)
