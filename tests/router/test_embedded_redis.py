"""The embedded redis-server (router/redis_server.py): it comes back when it dies, it goes
when the process that started it is killed outright, and a port it chose that another process
took first is not its end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_sync

from router import redis_server
from router.redis_server import EmbeddedRedis, PortTaken

REPO = Path(__file__).parents[2]


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_the_embedded_redis_comes_back_with_what_it_held() -> None:
    """Killed, the embedded redis-server is started again on its port by its watcher, and
    reloads its append-only file (API keys among what it held)."""
    with EmbeddedRedis() as server:
        client = redis_sync.Redis.from_url(server.url)
        client.set("outrider:probe", "kept")
        time.sleep(1.2)  # the append-only file is synced each second
        before = server.pid
        assert before is not None
        os.kill(before, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (server.pid == before or server.restarts == 0):
            time.sleep(0.1)
        assert server.restarts == 1 and server.pid != before
        assert client.get("outrider:probe") == b"kept"
        client.close()


def test_the_embedded_redis_goes_with_a_process_killed_outright() -> None:
    """A process that started an embedded redis-server and is killed with SIGKILL (no stop(),
    no clean-up: the OOM killer, say) takes it along: nothing answers on its port after."""
    code = (
        "import time\n"
        "from router.redis_server import EmbeddedRedis\n"
        "print(EmbeddedRedis().start().port, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert answers(port)
    finally:  # killed outright, as the test means, and never left running on a failure
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while answers(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not answers(port)


def test_a_port_taken_before_redis_binds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port it chose as free, bound by another process before redis-server binds it: it
    starts on another. A port it was given that is taken: it says so."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortTaken, match="redis-server exited at start"):
            EmbeddedRedis(port=port, restart=False).start()
        ports = iter([port])
        free = redis_server.free_port
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports, None) or free())
        with EmbeddedRedis(restart=False) as server:
            assert server.port != port
            client = redis_sync.Redis.from_url(server.url)
            assert client.ping()
            client.close()
