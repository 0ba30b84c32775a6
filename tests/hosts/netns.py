"""Separate network hosts on one machine: a Linux network namespace per host, each with its own
address on a bridge the test makes, and nothing else.

The bridge has no address of its own and the namespaces have no default route, so a process in
them can reach the other test hosts and nothing outside (not this machine's loopback, not the
internet). Every process a host starts runs in its namespace (`ip netns exec`); `close()` kills
whatever is still running in each namespace, whoever started it (Ray daemonizes its raylets),
then deletes the namespaces and the bridge. A host is cut off by taking its end of the veth pair
down (`cut`), as a switch port or a cable fails: packets stop, no socket is closed.

Needs root (CAP_NET_ADMIN) and iproute2; `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from string import ascii_lowercase
from typing import Any

SUBNET_PREFIX = 24
REPO = Path(__file__).resolve().parents[2]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (tried, then removed)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"orprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True, slots=True)
class Connection:
    """An established TCP connection seen from the host that accepted it."""

    client: str  # the connecting host's name
    server: str  # the accepting host's name
    port: int  # the accepting side's (listening) port


@dataclass(slots=True)
class Host:
    name: str
    address: str
    namespace: str
    veth: str  # the bridge's end of this host's pair: down cuts the host off
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def spawn(
        self, argv: list[str], env: dict[str, str], log: Path, cwd: str | None = None
    ) -> subprocess.Popen[bytes]:
        """A process in this host's namespace, its output appended to `log`."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                self.command(argv),
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def run(self, argv: list[str], env: dict[str, str], timeout_s: float) -> str:
        """Run to completion in this host's namespace; its output (raises on failure)."""
        done = subprocess.run(
            self.command(argv), env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{argv[0]} on host {self.name} exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def sockets(self) -> tuple[set[int], list[tuple[str, int, str, int]]]:
        """(listening TCP ports, established connections as (local address, local port,
        remote address, remote port)) in this host's namespace, from its /proc/net/tcp and
        tcp6 (gRPC's servers listen on dual-stack sockets: IPv4 peers as ::ffff:a.b.c.d)."""
        tables = subprocess.run(
            self.command(["cat", "/proc/net/tcp", "/proc/net/tcp6"]),
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
        listening: set[int] = set()
        established: list[tuple[str, int, str, int]] = []
        for line in tables.splitlines():
            fields = line.split()
            if not fields or fields[0] == "sl":
                continue
            (local_ip, local_port), (remote_ip, remote_port) = (
                _endpoint(fields[1]),
                _endpoint(fields[2]),
            )
            state = fields[3]
            if state == "0A":
                listening.add(local_port)
            elif state == "01":
                established.append((local_ip, local_port, remote_ip, remote_port))
        return listening, established


def sweep_stale() -> None:
    """Remove what a test process killed before its clean-up left: namespaces and bridges
    tagged with the pid of a process that is gone, and everything still running in them."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        found = re.match(r"or(\d+)[a-z]?-\S+", line)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            Network._kill_all(Host("stale", "", found.group(0), ""))
            _ip("netns", "del", found.group(0), check=False)
    links = _ip("link", "show", check=False).stdout
    for found in re.finditer(r"\d+: (orb(\d+)[a-z]?)[:@]", links):
        if not Path(f"/proc/{found.group(2)}").exists():
            _ip("link", "del", found.group(1), check=False)


def _endpoint(hex_endpoint: str) -> tuple[str, int]:
    """/proc/net/tcp's address (IPv4, or IPv6 in tcp6) as dotted IPv4 where it is one."""
    address, port = hex_endpoint.split(":")
    raw = bytes.fromhex(address)
    # Each 32-bit word is in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 16 and words[:12] == b"\0" * 10 + b"\xff\xff":
        words = words[12:]  # an IPv4-mapped address
    if len(words) == 4:
        return ".".join(str(b) for b in words), int(port, 16)
    return words.hex(), int(port, 16)


class Network:
    """A bridge and the hosts on it; a context manager that removes them whatever happens.

    A host named in `wired` reaches the bridge through a relay (tests/hosts/relay.py) in a
    namespace of its own, so `impair` can delay and drop its packets to a peer."""

    _made = itertools.count()

    def __init__(self, names: list[str], wired: Iterable[str] = ()) -> None:
        sweep_stale()
        # The process's pid and a letter for each network it made: "or<tag>h<i>" fits an
        # interface name's 15 characters, and sweep_stale finds a dead process's by the pid.
        self.tag = f"{os.getpid()}{ascii_lowercase[next(Network._made) % 26]}"
        self.bridge = f"orb{self.tag}"
        subnet = 200 + (os.getpid() + ord(self.tag[-1])) % 50
        self.hosts: dict[str, Host] = {}
        self.wires: dict[str, Host] = {}  # a wired host's relay, by the host's name
        self.rules = Path(tempfile.mkdtemp(prefix=f"or{self.tag}-")) / "rules.json"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                address = f"10.{subnet}.0.{i + 2}"
                self.hosts[name] = self._add_host(name, i, address, name in set(wired))
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, index: int, address: str, wired: bool) -> Host:
        """The host's namespace and its veth pair to the bridge; a wired host's pair ends in
        its relay's namespace instead, joined to the bridge by a second pair (`_wire`)."""
        namespace = f"or{self.tag}-{name}"
        veth, inside = f"or{self.tag}h{index}", f"or{self.tag}n{index}"
        _ip("netns", "add", namespace)
        host = Host(name, address, namespace, veth)
        wire_in = f"or{self.tag}w{index}"
        _ip("link", "add", wire_in if wired else veth, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        if wired:
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"or{self.tag}o{index}")
            _ip("-n", namespace, "link", "set", inside, "gso_max_segs", "1")
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{SUBNET_PREFIX}", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        if wired:
            self.wires[name] = self._wire(host, wire_in, f"or{self.tag}o{index}")
        return host

    def _wire(self, host: Host, inside: str, outside: str) -> Host:
        """Start the relay (tests/hosts/relay.py) between the host's pair (`inside`) and the
        bridge's (`outside`), in a namespace of its own. Segmentation offload is off on the
        relay's path (gso_max_segs 1): one frame is one packet, as on a wire."""
        wire = Host(f"{host.name}-wire", "", f"{host.namespace}-wire", inside)
        _ip("netns", "add", wire.namespace)
        _ip("link", "set", host.veth, "gso_max_segs", "1")
        for end in (inside, outside):
            _ip("link", "set", end, "netns", wire.namespace)
            _ip("-n", wire.namespace, "link", "set", end, "gso_max_segs", "1")
            _ip("-n", wire.namespace, "link", "set", end, "promisc", "on", "up")
        argv = [sys.executable, "-m", "tests.hosts.relay", "--inside", inside]
        argv += ["--outside", outside, "--rules", str(self.rules)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
        wire.spawn(argv, env, self.rules.with_name(f"{host.name}-wire.log"), cwd=str(REPO))
        return wire

    def impair(self, a: str, peers: list[str], delay_s: float, loss: float) -> None:
        """Hold every packet between host `a` (a wired one) and each of `peers` `delay_s` and
        drop it with probability `loss`, each way; the relay reads this within a quarter
        second."""
        self._write_rules(
            [
                {"between": [self[a].address, self[b].address], "delay_s": delay_s, "loss": loss}
                for b in peers
            ]
        )

    def wire_counts(self, name: str) -> dict[str, int]:
        """The relay of wired host `name`'s counts so far: frames copied, held and dropped."""
        inside = self.wires[name].veth  # a relay's Host names its interface facing the host
        path = self.rules.with_name(f"{self.rules.stem}.{inside}.json")
        return json.loads(path.read_text()) if path.exists() else {}

    def repair(self) -> None:
        self._write_rules([])

    def _write_rules(self, rules: list[dict[str, Any]]) -> None:
        staged = self.rules.with_suffix(".new")
        staged.write_text(json.dumps(rules))
        staged.replace(self.rules)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def host_of(self, address: str) -> str | None:
        return next((h.name for h in self.hosts.values() if h.address == address), None)

    # -- failures -------------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Cut the host off the bridge: its packets stop, its sockets stay open."""
        _ip("link", "set", self.hosts[name].veth, "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.hosts[name].veth, "up")

    # -- what crossed ---------------------------------------------------------------------------

    def connections(self) -> set[Connection]:
        """The TCP connections open now between two different hosts, by who accepted them."""
        seen: set[Connection] = set()
        for host in self.hosts.values():
            listening, established = host.sockets()
            for local_ip, local_port, remote_ip, _ in established:
                client = self.host_of(remote_ip)
                accepted = local_port in listening and local_ip == host.address
                if accepted and client is not None and client != host.name:
                    seen.add(Connection(client, host.name, local_port))
        return seen

    # -- removal --------------------------------------------------------------------------------

    def close(self) -> None:
        every = [*self.hosts.values(), *self.wires.values()]
        for host in every:
            self._kill_all(host)
        for host in every:
            _ip("netns", "del", host.namespace, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.rules.parent, ignore_errors=True)
        self.hosts.clear()
        self.wires.clear()

    @staticmethod
    def _kill_all(host: Host) -> None:
        """Every process in the host's namespace, started by us or daemonized from them."""
        for _ in range(3):
            listed = _ip("netns", "pids", host.namespace, check=False).stdout.split()
            if not listed:
                break
            for pid in listed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
        for process in host.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
