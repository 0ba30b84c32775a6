"""Tensor links: a process group of two between a pair of actors, for tensors that must not go
through Ray's object store (hidden states, KV blocks).

A link is built without a global default group, so one process can hold many: the side that
hosts it opens a `TCPStore` on a free port and hands the address to its peer through an ordinary
Ray call; both sides wrap the store in a `PrefixStore` named after the link and construct the
backend's process group directly (`ProcessGroupGloo` for CPU tensors, `ProcessGroupNCCL` for
CUDA tensors where NCCL exists; the CPU wheel rejects a combined "cpu:gloo,cuda:nccl" backend
string, and constructing the class directly needs no backend string at all). Construction is
collective, so the host starts its half while the peer's call is in flight.

NCCL carries a link only when every member holds its tensors on a GPU (`link_backend`); a link
with a CPU member (a drafter on the Grace CPU beside a GPU verifier, say) is gloo, and a GPU
member's tensors cross it through host memory: sent from a host copy, received into one and
copied onto the GPU. A link's tensors arrive on `link.device` unless received into a buffer.

Every operation waits at most the link's timeout (torch's default would be 30 minutes), and a
peer that died surfaces as `LinkError` at once (gloo notices the closed socket), so the caller
can rebuild the link once the peer is back.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 10.0
MAX_IN_FLIGHT = 8  # unmatched sends before `send(wait=False)` waits for the oldest


class LinkError(RuntimeError):
    """A link operation failed or timed out (usually: the peer is gone)."""


@dataclass(frozen=True, slots=True)
class LinkAddress:
    """What the joining side needs: plain data, passed in a Ray call."""

    link_id: str
    host: str
    port: int
    backend: str  # "gloo" or "nccl"
    world: int = 2  # a pair; a tensor-parallel group has one rank per member


def node_address() -> str:
    """This node's address as the peer should dial it."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def gloo_options(timeout: datetime.timedelta) -> Any:
    """Gloo's options with its device bound to `node_address()`, the address the peers dial.
    Gloo's own default binds what the machine's hostname resolves to, which on many hosts
    (Debian's 127.0.1.1, a container without DNS) is a loopback address that a member on
    another host cannot reach. GLOO_SOCKET_IFNAME, where set, names the interface instead."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        device = dist.ProcessGroupGloo.create_device(interface=interface)
    else:
        device = dist.ProcessGroupGloo.create_device(hostname=node_address())
    options._devices = [device]
    return options


def link_backend(*devices: torch.device | str) -> str:
    """NCCL where every member's tensors are on a GPU and NCCL exists; else gloo."""
    if all(torch.device(d).type == "cuda" for d in devices) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


class TensorLink:
    """One member of a link: rank 0 hosts, the others join. Any two members send and receive
    (in a pair the peer is implied; a bigger group names it); any size all-reduces (the
    tensor-parallel group of a verifier)."""

    def __init__(self, address: LinkAddress, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.rank = rank
        self.peer = 1 - rank if address.world == 2 else -1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: dist.Store | None = None
        self._group: Any = None  # ProcessGroupGloo or ProcessGroupNCCL
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def host(
        cls,
        link_id: str,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        world: int = 2,
    ) -> TensorLink:
        """Open the store; `connect()` then completes the link once the others join."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            node_address(), 0, world, True, timeout=timeout, wait_for_workers=False
        )
        address = LinkAddress(link_id, node_address(), store.port, backend, world)
        link = cls(address, 0, timeout_s)
        link._store = store
        return link

    @classmethod
    def join(
        cls, address: LinkAddress, timeout_s: float = DEFAULT_TIMEOUT_S, rank: int = 1
    ) -> TensorLink:
        link = cls(address, rank, timeout_s)
        link._store = dist.TCPStore(
            address.host, address.port, address.world, False, timeout=link.timeout
        )
        link.connect()
        return link

    def connect(self) -> None:
        """Construct the process group (collective: the peer does the same)."""
        assert self._store is not None
        store = dist.PrefixStore(self.address.link_id, self._store)
        try:
            if self.address.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                world = self.address.world
                self._group = dist.ProcessGroupNCCL(store, self.rank, world, options)
            else:
                self._group = dist.ProcessGroupGloo(
                    store, self.rank, self.address.world, gloo_options(self.timeout)
                )
        except RuntimeError as err:
            raise LinkError(f"link {self.address.link_id}: could not connect: {err}") from err

    def connect_racing(self, joined: Any, poll_s: float = 0.05) -> None:
        """`connect()` on the hosting side while the peer's Ray call `joined` (an ObjectRef)
        joins; given up with `LinkError` as soon as that call fails (the peer died before it
        joined) instead of after the link's timeout, which a prefill link sets at minutes. The
        abandoned half times out on its own thread. The caller still `ray.get`s `joined`."""
        import ray

        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.connect()
            except BaseException as err:  # handed to the caller below
                errors.append(err)
            finally:
                done.set()

        threading.Thread(target=run, name=f"link-{self.address.link_id}", daemon=True).start()
        peer_joined = False
        while not done.wait(poll_s):
            if peer_joined or not ray.wait([joined], timeout=0)[0]:
                continue
            try:
                ray.get(joined)
            except Exception as err:
                raise LinkError(
                    f"link {self.address.link_id}: the peer failed before it joined: {err}"
                ) from err
            peer_joined = True  # its half is done: ours completes at once
        if errors:
            raise errors[0]

    @property
    def connected(self) -> bool:
        return self._group is not None

    @property
    def device(self) -> torch.device:
        """Where the backend takes tensors: the GPU for NCCL, host memory for gloo."""
        return torch.device("cuda" if self.address.backend == "nccl" else "cpu")

    def close(self) -> None:
        self._group = None
        self._store = None
        self._in_flight.clear()

    # -- moving tensors ------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, wait: bool = True, peer: int | None = None) -> None:
        """Send to the peer. A send completes only once the peer posts the matching `recv`; with
        `wait=False` it is left in flight (the tensor kept alive) and reaped later, so a caller
        never blocks on a peer that is still busy with earlier work."""
        tensor = tensor.to(self.device).contiguous()  # a GPU tensor over gloo: a host copy
        group = self._require()
        try:
            work = group.send([tensor], self._peer(peer), 0)
        except RuntimeError as err:  # a broken pair fails at once
            self.close()
            raise LinkError(f"link {self.address.link_id}: {err}") from err
        self._in_flight.append((work, tensor))
        if wait:
            self.flush()
        else:
            self._reap()

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, peer: int | None = None
    ) -> torch.Tensor:
        """The next tensor from the peer, on `self.device`."""
        return self.recv_into(torch.empty(shape, dtype=dtype, device=self.device), peer)

    def recv_into(self, out: torch.Tensor, peer: int | None = None) -> torch.Tensor:
        """Receive into `out` (contiguous: a slice of a bigger buffer is fine; elsewhere than
        `self.device`, through a buffer there)."""
        if not out.is_contiguous():
            raise ValueError("a link receives into contiguous tensors only")
        here = out.device.type == self.device.type
        staged = out if here else torch.empty_like(out, device=self.device)
        group = self._require()
        try:
            work = group.recv([staged], self._peer(peer), 0)
        except RuntimeError as err:
            self.close()
            raise LinkError(f"link {self.address.link_id}: {err}") from err
        self._wait(work)
        if staged is not out:
            out.copy_(staged)
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over every member, in place (and returned)."""
        staged = tensor.to(self.device)  # itself where it is on the link's device already
        self._wait(self._require().allreduce([staged]))
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    def flush(self) -> None:
        """Wait for every send in flight."""
        while self._in_flight:
            work, _ = self._in_flight.pop(0)
            self._wait(work)

    def _reap(self) -> None:
        while self._in_flight and self._completed(self._in_flight[0][0]):
            work, _ = self._in_flight.pop(0)
            self._wait(work)  # raises if it failed
        if len(self._in_flight) > MAX_IN_FLIGHT:
            work, _ = self._in_flight.pop(0)
            self._wait(work)

    def _completed(self, work: dist.Work) -> bool:
        try:
            return bool(work.is_completed())
        except RuntimeError:
            return True  # finished with an error: `_wait` raises it

    def _peer(self, peer: int | None) -> int:
        if peer is None:
            if self.peer < 0:
                raise ValueError(f"a link of {self.address.world} members needs the peer named")
            return self.peer
        if not 0 <= peer < self.address.world or peer == self.rank:
            raise ValueError(f"no peer {peer} for member {self.rank} of {self.address.world}")
        return peer

    def _require(self) -> Any:
        if self._group is None:
            raise LinkError(f"link {self.address.link_id} is not connected")
        return self._group

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as err:
            self.close()  # a broken group cannot be reused: the caller rebuilds the link
            raise LinkError(f"link {self.address.link_id}: {err}") from err
