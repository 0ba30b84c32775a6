"""One router replica: the HTTP API (uvicorn) and the gRPC API on one asyncio loop, over a
backend (the Ray runtime, or one in-process engine) and Redis.

`Router.serve()` runs until `stop()`, or until `drain()` has let the requests in flight finish:
the first SIGTERM or SIGINT drains (Kubernetes stopping a pod, Ctrl-C), a second one stops at
once. `RouterThread` runs a router on a background thread (tests, benchmarks). API keys come
from the replica's own configuration (router/keys.py: a keys file, read again when it changes,
or a list) and switch authentication on; a replica without keys serves an open API. With a
certificate and key file both APIs speak TLS only (router/tls.py). A router's loop is uvloop's
(libuv's, in C) where it is installed, as it is with Outrider's dependencies: `run_router`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from redis.exceptions import RedisError

from cluster.config import MigrationSettings
from router import keys as api_keys
from router.backends import Backend
from router.keys import KeyLimits, KeyLine, KeyRing
from router.protocol import RequestBuilder
from router.routing import RoutingPolicy
from router.service import RouterService
from router.state import KEYS_TTL_S, LEASE_S, SharedState
from router.tls import TlsFiles

log = logging.getLogger(__name__)
# After a drain's grace period, how long the requests it cut get to send their error and close.
CUT_WAIT_S = 2.0


REDIS_TIMEOUT_S = 2.0


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a router runs on: uvloop's where it is installed (a streamed token
    costs the loop 13% less CPU at 16 streams than asyncio's own loop, docs/benchmarks.md),
    else asyncio's (None)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_router(coro: Coroutine[Any, Any, None]) -> None:
    """Run a router's coroutine to its end on a new event loop (`event_loop_factory`), as
    `asyncio.run` would."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(coro)


@dataclass(slots=True)
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051  # None: no gRPC server
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = None
    max_queue: int = 256
    block_size: int = 16
    # What keys get unless their line says otherwise (requests/s, concurrency, tokens/s ...).
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    api_keys: list[KeyLine] = field(default_factory=list)
    api_keys_file: str | None = None  # read again when it changes; keys gone from it are revoked
    tls_cert_file: str | None = None  # with tls_key_file: HTTPS and gRPC over TLS only
    tls_key_file: str | None = None
    docs: bool = True  # the OpenAPI document and its pages (/docs, /redoc, /openapi.json)
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    # How long a drain lets the requests in flight run before it cuts them.
    shutdown_grace_s: float = 30.0
    migration: MigrationSettings = field(default_factory=MigrationSettings)
    # A key's concurrency lease lapses this long after its replica last renewed it (a replica
    # that died gives its places back within it).
    lease_s: float = LEASE_S


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT calls `on_signal` (a drain) instead of
    stopping it; a second one stops it as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._signalled = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._signalled = True  # and serve() returns once the drain has stopped it
        self._on_signal()


class Router:
    def __init__(
        self,
        backend: Backend,
        builder: RequestBuilder,
        options: RouterOptions,
        announce: Callable[[Router], None] | None = None,
    ) -> None:
        """`announce`, when given, is called on the event loop once both servers listen (its
        router's `port` and `grpc_port` then say where): where to send requests is printed
        only once they are there."""
        self.backend, self.builder, self.options = backend, builder, options
        self._announce = announce
        self.service: RouterService | None = None
        # The ports it listens on once started: the options', or with port 0 there the one the
        # OS chose (a caller that picked a free port first could lose it before the bind).
        self.port: int | None = None
        self.grpc_port: int | None = None
        self.started = threading.Event()
        self._http: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        import redis.asyncio as aioredis

        from router.grpc_api import start_grpc
        from router.http_api import create_app

        opts = self.options
        # Bounded waits: a Redis that stops answering is an outage (router/registry.py), not
        # a request that hangs.
        client = aioredis.Redis.from_url(
            opts.redis_url,
            password=opts.redis_password,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            socket_timeout=REDIS_TIMEOUT_S,
        )
        state = SharedState(client)
        keys = KeyRing(opts.api_keys, opts.api_keys_file, opts.key_limits)
        tls = None
        if opts.tls_cert_file or opts.tls_key_file:
            if not (opts.tls_cert_file and opts.tls_key_file):
                raise ValueError("TLS needs both a certificate file and a key file")
            tls = TlsFiles(opts.tls_cert_file, opts.tls_key_file)
        service = RouterService(
            self.backend,
            self.builder,
            state,
            opts.block_size,
            opts.max_queue,
            opts.policy,
            migration=opts.migration,
            keys=keys,
            lease_s=opts.lease_s,
        )
        service.redis.on_back.append(lambda: state.sync_keys(keys.keys))
        self.service = service
        config = uvicorn.Config(
            create_app(service, opts.docs),
            host=opts.host,
            port=opts.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            ssl_context_factory=None if tls is None else (lambda *_: tls.ssl_context),
        )
        self._http = _DrainingServer(config, self.drain)
        self._loop = asyncio.get_running_loop()
        grpc_server: Any = None
        watch = asyncio.create_task(_watch_files(service, keys, tls))
        renew = asyncio.create_task(_renew_leases(service, opts.lease_s))
        try:
            if opts.grpc_port is not None:
                credentials = None if tls is None else tls.grpc_credentials()
                grpc_server, self.grpc_port = await start_grpc(
                    service, opts.host, opts.grpc_port, credentials
                )
            http = asyncio.create_task(self._http.serve())
            while not self._http.started and not http.done():
                await asyncio.sleep(0.02)
            if not http.done():
                self.port = self._http.servers[0].sockets[0].getsockname()[1]
                self.started.set()
                if self._announce is not None:
                    self._announce(self)
            await http
        finally:
            watch.cancel()
            renew.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=2)
            await service.drain()
            service.redis.close()
            await state.close()
            self.started.set()  # a failed start must not leave a waiter hanging

    def stop(self) -> None:
        """Ask the servers to stop (from any thread); `serve` returns once they have."""
        if self._http is not None:
            self._http.should_exit = True

    def drain(self) -> None:
        """Shut down gracefully (from any thread, or a signal handler): refuse new requests
        (503, `/ready` too) and let those in flight finish, for up to `shutdown_grace_s`; then
        cut what still runs (each ends with a 503 error that says how to resume it from the
        registry) and stop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained())

    async def _drained(self) -> None:
        service = self.service
        assert service is not None and self._loop is not None
        service.draining = True
        grace = self.options.shutdown_grace_s
        log.warning(
            "shutting down: %d requests in flight get up to %.0f s to finish "
            "(send the signal again to stop now)",
            service.in_flight,
            grace,
        )
        await _until_idle(service, self._loop.time() + grace)
        if service.in_flight:
            log.warning("cutting %d requests still in flight", service.in_flight)
            service.cut = True
            await _until_idle(service, self._loop.time() + CUT_WAIT_S)
        self.stop()


async def _watch_files(service: RouterService, keys: KeyRing, tls: TlsFiles | None) -> None:
    """Read the keys file and the TLS files again when they change, and keep Redis's key
    mirror what the keys are: rewritten when they change or the mirror differs (Redis lost it,
    or someone wrote into it), else well within its TTL."""
    every = min(api_keys.RELOAD_EVERY_S, KEYS_TTL_S / 10)
    synced_at: float | None = None
    loop = asyncio.get_running_loop()
    while True:
        changed = keys.reload_if_changed()
        if tls is not None:
            tls.reload_if_changed()
        if service.redis.up:
            try:
                due = synced_at is None or loop.time() - synced_at >= KEYS_TTL_S / 4
                mirrored = set(await service.state.mirrored_keys())
                if changed or due or mirrored != {key.digest for key in keys.keys}:
                    await service.state.sync_keys(keys.keys)
                    synced_at = loop.time()
            except RedisError as exc:
                service.redis.failed(exc)
        await asyncio.sleep(every)


async def _renew_leases(service: RouterService, lease_s: float) -> None:
    """Renew this replica's concurrency leases three times a lease."""
    while True:
        await asyncio.sleep(lease_s / 3)
        await service.admission.renew_leases()


async def _until_idle(service: RouterService, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while service.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)


class RouterThread:
    """A router on its own thread and event loop."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router", daemon=True)

    def _run(self) -> None:
        try:
            run_router(self.router.serve())
        except BaseException as exc:
            self.error = exc
            self.router.started.set()

    def start(self, timeout_s: float = 60.0) -> RouterThread:
        self._thread.start()
        if not self.router.started.wait(timeout_s):
            raise TimeoutError("the router did not start")
        if self.error is not None:
            raise RuntimeError(f"the router failed to start: {self.error!r}") from self.error
        return self

    def stop(self) -> None:
        self.router.stop()
        self._thread.join(timeout=30)
