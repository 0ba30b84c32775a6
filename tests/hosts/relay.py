"""A slow, lossy wire for the multi-host test bed, since this kernel has no `netem` qdisc:
`python -m tests.hosts.relay --inside IF --outside IF --rules FILE`, run in a namespace of its
own between a host and the bridge (tests/hosts/netns.py wires it).

It copies every Ethernet frame from one interface to the other (raw AF_PACKET sockets: the
frames are the hosts' own, nothing is routed or rewritten). An IPv4 frame between two addresses
a rule names is held `delay_s` and dropped with probability `loss`, each direction and each frame
on its own, as `netem delay ... loss ...` would on both ends of the link; every other frame
crosses at once. The rules file is JSON, `[{"between": [A, B], "delay_s": s, "loss": p}]`, read
again whenever it changes, so a test can slow the link mid-load and mend it after. Beside it
(`<rules>.<inside>.json`) the relay keeps its counts: frames copied, held and dropped.

Frames are read and written with their virtio-net header (PACKET_VNET_HDR): a veth leaves TCP
checksums to "hardware", and the header carries that through the relay. Segmentation offload is
off on the relay's path (gso_max_segs 1, set by netns.py), so a frame is one packet and 5% loss
is 5% of packets, not of 64 KB bursts.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import random
import select
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4  # a frame this socket's interface sent: ours, not one to copy
SOL_PACKET = 263
PACKET_VNET_HDR = 15
VNET_HDR_BYTES = 10  # struct virtio_net_hdr, before each frame read and written
FRAME_BYTES = 65536
RULES_EVERY_S = 0.25


@dataclass(frozen=True, slots=True)
class Rule:
    between: frozenset[bytes]  # two IPv4 addresses, packed
    delay_s: float
    loss: float


def load_rules(path: Path) -> list[Rule]:
    if not path.exists():
        return []
    return [
        Rule(
            frozenset(socket.inet_aton(a) for a in rule["between"]),
            float(rule.get("delay_s", 0.0)),
            float(rule.get("loss", 0.0)),
        )
        for rule in json.loads(path.read_text() or "[]")
    ]


def rule_for(frame: bytes, rules: list[Rule]) -> Rule | None:
    """The rule naming this frame's IPv4 source and destination, if it is IPv4 and one does."""
    if len(frame) < 34 or struct.unpack_from("!H", frame, 12)[0] != ETH_P_IP:
        return None
    ends = frozenset((frame[26:30], frame[30:34]))
    return next((r for r in rules if r.between == ends), None)


class Wire:
    def __init__(self, inside: str, outside: str, rules: Path, seed: int) -> None:
        self.sockets = {inside: self._open(inside), outside: self._open(outside)}
        self.other = {inside: self.sockets[outside], outside: self.sockets[inside]}
        self.rules_path = rules
        self.rules: list[Rule] = []
        self.rules_stamp: float | None = None
        self.random = random.Random(seed)
        self.held: list[tuple[float, int, socket.socket, bytes]] = []  # (due, order, to, frame)
        self.order = 0
        self.counts = {"copied": 0, "held": 0, "dropped": 0}
        self.counts_path = rules.with_name(f"{rules.stem}.{inside}.json")
        self.counts_written: dict[str, int] = {}

    @staticmethod
    def _open(interface: str) -> socket.socket:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        # A veth leaves TCP checksums to "hardware" (CHECKSUM_PARTIAL): the header carries
        # that through, so the far veth takes the frame as the near one would have.
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.bind((interface, 0))
        sock.setblocking(False)
        return sock

    def _reload(self) -> None:
        stamp = self.rules_path.stat().st_mtime if self.rules_path.exists() else None
        if stamp != self.rules_stamp:
            self.rules_stamp = stamp
            self.rules = load_rules(self.rules_path)
        if self.counts != self.counts_written:
            staged = self.counts_path.with_suffix(".new")
            staged.write_text(json.dumps(self.counts))
            staged.replace(self.counts_path)
            self.counts_written = dict(self.counts)

    def _take(self, interface: str, now: float) -> None:
        sock = self.sockets[interface]
        while True:
            try:
                frame, address = sock.recvfrom(FRAME_BYTES)
            except BlockingIOError:
                return
            if address[2] == PACKET_OUTGOING:
                continue
            rule = rule_for(frame[VNET_HDR_BYTES:], self.rules)
            if rule is None:
                self.counts["copied"] += 1
                self._send(self.other[interface], frame)
            elif self.random.random() < rule.loss:
                self.counts["dropped"] += 1
            else:
                self.counts["held"] += 1
                self.order += 1
                heapq.heappush(
                    self.held, (now + rule.delay_s, self.order, self.other[interface], frame)
                )

    @staticmethod
    def _send(sock: socket.socket, frame: bytes) -> None:
        # An interface down (the host cut off) loses the frame, as a wire would.
        with contextlib.suppress(OSError):
            sock.send(frame)

    def run(self) -> None:
        checked = 0.0
        names = {s.fileno(): name for name, s in self.sockets.items()}
        while True:
            now = time.monotonic()
            if now - checked >= RULES_EVERY_S:
                self._reload()
                checked = now
            while self.held and self.held[0][0] <= now:
                _, _, to, frame = heapq.heappop(self.held)
                self._send(to, frame)
            wait = RULES_EVERY_S if not self.held else max(0.0, self.held[0][0] - now)
            ready, _, _ = select.select(list(self.sockets.values()), [], [], wait)
            now = time.monotonic()
            for sock in ready:
                self._take(names[sock.fileno()], now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inside", required=True, help="the interface facing the host")
    parser.add_argument("--outside", required=True, help="the interface facing the bridge")
    parser.add_argument("--rules", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    Wire(args.inside, args.outside, args.rules, args.seed).run()


if __name__ == "__main__":
    main()
