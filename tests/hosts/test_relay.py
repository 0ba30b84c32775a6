"""The test bed's slow, lossy wire (tests/hosts/relay.py): a wired host's packets to the peer a
rule names are held and dropped, everything else crosses at once, and `repair` undoes it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.hosts.netns import Network, unavailable

PORT = 5000
# Connects to the far host's listener and prints how long the handshake took (or "none").
CONNECT = """
import socket, sys, time
t0 = time.perf_counter()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print(time.perf_counter() - t0)
except OSError:
    print("none")
"""
LISTEN = "import socket, time\nserver = socket.create_server(('0.0.0.0', 5000))\ntime.sleep(600)"


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no multi-host test bed: {reason}")
    with Network(["near", "far", "other"], wired=["near"]) as net:
        log = tmp_path_factory.mktemp("relay") / "listen.log"
        for host in ("far", "other"):
            net[host].spawn([sys.executable, "-c", LISTEN], {"PATH": "/usr/bin:/bin"}, log)
        _wait_until(lambda: _handshake(net, "far", 2.0) is not None, 15.0)
        yield net


def _handshake(net: Network, to: str, timeout_s: float) -> float | None:
    argv = [sys.executable, "-c", CONNECT, net[to].address, str(PORT), str(timeout_s)]
    out = net["near"].run(argv, {"PATH": "/usr/bin:/bin"}, timeout_s + 10).strip()
    return None if out == "none" else float(out)


def _wait_until(check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise TimeoutError(f"not within {timeout_s} s")


def test_a_wired_hosts_packets_to_a_named_peer_are_held_and_dropped(network: Network) -> None:
    plain = _handshake(network, "far", 2.0)
    assert plain is not None and plain < 0.05
    network.impair("near", ["far"], delay_s=0.1, loss=0.0)
    time.sleep(0.6)  # the relay reads its rules every quarter second
    held = _handshake(network, "far", 2.0)
    assert held is not None and held >= 0.2  # SYN and SYN-ACK each held 0.1 s
    other = _handshake(network, "other", 2.0)  # no rule names it: at once
    assert other is not None and other < 0.05
    network.impair("near", ["far"], delay_s=0.0, loss=1.0)
    time.sleep(0.6)
    assert _handshake(network, "far", 1.0) is None
    network.repair()
    time.sleep(0.6)
    mended = _handshake(network, "far", 2.0)
    assert mended is not None and mended < 0.05
    counts = network.wire_counts("near")
    assert counts["held"] >= 2 and counts["dropped"] >= 1 and counts["copied"] > 0


def test_cutting_a_wired_host_stops_its_packets(network: Network) -> None:
    network.cut("near")
    try:
        assert _handshake(network, "other", 1.0) is None
    finally:
        network.mend("near")
    _wait_until(lambda: _handshake(network, "other", 1.0) is not None, 10.0)


def test_the_relay_goes_with_the_network() -> None:
    if unavailable() is not None:
        pytest.skip("no multi-host test bed")
    with Network(["a", "b"], wired=["b"]) as net:
        wire = net.wires["b"].namespace
        rules = net.rules
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert wire not in listed and not rules.parent.exists()
