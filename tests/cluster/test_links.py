"""Tensor links between two endpoints (threads here; actors in test_runtime.py): tensors arrive
intact and in order, sends can stay in flight, and a vanished peer is a prompt `LinkError`."""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.links import LinkError, TensorLink


def pair(name: str, timeout_s: float = 5.0) -> tuple[TensorLink, TensorLink]:
    host = TensorLink.host(name, timeout_s=timeout_s)
    joined: dict[str, TensorLink] = {}
    thread = threading.Thread(
        target=lambda: joined.setdefault("peer", TensorLink.join(host.address, timeout_s))
    )
    thread.start()
    host.connect()
    thread.join()
    return host, joined["peer"]


def test_tensors_arrive_in_order_with_sends_in_flight() -> None:
    host, peer = pair("order")
    sent = [
        torch.arange(6, dtype=dtype).reshape(2, 3) * (i + 1)
        for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int64])
    ]
    for tensor in sent:
        host.send(tensor, wait=False)  # the peer has not posted a receive yet
    got = [peer.recv((2, 3), t.dtype) for t in sent]
    host.flush()
    for want, have in zip(sent, got, strict=True):
        assert torch.equal(want, have)
    # And back the other way (a send completes only once the receive is posted).
    peer.send(torch.ones(4), wait=False)
    assert torch.equal(host.recv((4,), torch.float32), torch.ones(4))
    peer.flush()


def test_two_links_in_one_process_do_not_mix() -> None:
    a_host, a_peer = pair("link-a")
    b_host, b_peer = pair("link-b")
    a_host.send(torch.full((3,), 1.0), wait=False)
    b_host.send(torch.full((3,), 2.0), wait=False)
    assert torch.equal(b_peer.recv((3,), torch.float32), torch.full((3,), 2.0))
    assert torch.equal(a_peer.recv((3,), torch.float32), torch.full((3,), 1.0))


def test_a_peer_that_never_answers_is_a_timeout_not_a_hang() -> None:
    host, peer = pair("quiet", timeout_s=1.0)
    with pytest.raises(LinkError):
        host.recv((2,), torch.float32)  # the peer never sends
    assert not host.connected
    with pytest.raises(LinkError, match="not connected"):
        host.send(torch.zeros(2))
    del peer
