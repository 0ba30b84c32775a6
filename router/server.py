"""One router replica: the HTTP API (uvicorn) and the gRPC API on one asyncio loop, over a
backend (the Ray runtime, or one in-process engine) and Redis.

`Router.serve()` runs until `stop()`, or until `drain()` has let the requests in flight finish:
the first SIGTERM or SIGINT drains (Kubernetes stopping a pod, Ctrl-C), a second one stops at
once. `RouterThread` runs a router on a background thread (tests, benchmarks). API keys come
from a file (one per line: `<key> [name] [requests/s] [burst]`, `#` comments), are stored
hashed in Redis, and switch authentication on; without any key in Redis the API is open.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from cluster.config import MigrationSettings
from router.backends import Backend
from router.protocol import RequestBuilder
from router.service import RouterService, RoutingPolicy
from router.state import SharedState

log = logging.getLogger(__name__)
# After a drain's grace period, how long the requests it cut get to send their error and close.
CUT_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class KeyLine:
    key: str
    name: str
    requests_per_s: float | None
    burst: int | None


def read_keys_file(path: str | Path) -> list[KeyLine]:
    """Parse an API keys file; raises ValueError naming the bad line."""
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 4:
            raise ValueError(f"{path}:{number}: expected '<key> [name] [requests/s] [burst]'")
        try:
            rate = float(fields[2]) if len(fields) > 2 else None
            burst = int(fields[3]) if len(fields) > 3 else None
        except ValueError:
            raise ValueError(f"{path}:{number}: requests/s and burst must be numbers") from None
        name = fields[1] if len(fields) > 1 else f"key-{number}"
        keys.append(KeyLine(fields[0], name, rate, burst))
    return keys


REDIS_TIMEOUT_S = 2.0


@dataclass(slots=True)
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = 50051  # None: no gRPC server
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = None
    max_queue: int = 256
    block_size: int = 16
    requests_per_s: float = 0.0  # default bucket for keys that do not set their own
    burst: int = 0
    api_keys: list[KeyLine] = field(default_factory=list)
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    # How long a drain lets the requests in flight run before it cuts them.
    shutdown_grace_s: float = 30.0
    migration: MigrationSettings = field(default_factory=MigrationSettings)


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
    def __init__(self, backend: Backend, builder: RequestBuilder, options: RouterOptions) -> None:
        self.backend, self.builder, self.options = backend, builder, options
        self.service: RouterService | None = None
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

        async def add_keys() -> None:
            for line in opts.api_keys:
                await state.add_key(
                    line.key,
                    line.name,
                    opts.requests_per_s if line.requests_per_s is None else line.requests_per_s,
                    opts.burst if line.burst is None else line.burst,
                )

        await add_keys()
        service = RouterService(
            self.backend,
            self.builder,
            state,
            opts.block_size,
            opts.max_queue,
            opts.policy,
            migration=opts.migration,
        )
        service.redis.on_back.append(add_keys)
        self.service = service
        config = uvicorn.Config(
            create_app(service),
            host=opts.host,
            port=opts.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._http = _DrainingServer(config, self.drain)
        self._loop = asyncio.get_running_loop()
        grpc_server: Any = None
        try:
            if opts.grpc_port is not None:
                grpc_server, _ = await start_grpc(service, opts.host, opts.grpc_port)
            http = asyncio.create_task(self._http.serve())
            while not self._http.started and not http.done():
                await asyncio.sleep(0.02)
            if not http.done():
                self.started.set()
            await http
        finally:
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
            asyncio.run(self.router.serve())
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
