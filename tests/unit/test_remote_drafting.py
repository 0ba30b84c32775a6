"""A drafter actor that stops answering (cluster/remote_drafting.py), without Ray: its replies
late for `LOST_AFTER_S` in all, the verifier's proxy takes it for lost, and from then on a step
neither waits on it nor on rebuilding its connection, which happens on a thread of its own;
once rebuilt, every live sequence is re-added. The real path (a drafter killed, a host cut off)
is in tests/cluster/test_runtime.py and tests/hosts."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from cluster import remote_drafting
from cluster.remote_drafting import RemoteDrafter, _Connection
from cluster.step_channel import ChannelTimeout
from workers.drafting.base import DraftRequest
from workers.engine.sampling_params import SamplingParams


class _SilentChannel:
    """A channel whose peer never answers: each reply waits out its deadline."""

    def __init__(self) -> None:
        self.sent = 0

    def request(self, payload: Any) -> int:
        self.sent += 1
        return self.sent

    def reply(self, seq: int, deadline: float | None) -> Any:
        assert deadline is not None
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise ChannelTimeout("no reply by the deadline")

    def close(self) -> None:
        pass


class _Proxy(RemoteDrafter):
    """A RemoteDrafter whose connections are made here; the second waits until let through."""

    def __init__(self) -> None:
        self.opened = 0
        self.let_through = threading.Event()
        super().__init__(actor=None, method="eagle", deadline_s=0.05, name="drafter-test")

    def _open(self) -> _Connection:
        self.opened += 1
        if self.opened > 1:
            assert self.let_through.wait(10)
        link: Any = object()  # no features are sent here
        return _Connection(link=link, channel=_SilentChannel(), incarnation=self.opened)  # type: ignore[arg-type]


def test_a_silent_drafter_is_lost_and_reconnected_off_the_engines_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_drafting, "LOST_AFTER_S", 0.12)
    monkeypatch.setattr(remote_drafting, "RECONNECT_EVERY_S", 0.0)
    proxy = _Proxy()
    proxy.add("r1", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    asks = [DraftRequest("r1", 3, 4)]
    steps = 0
    while proxy._incarnation is not None:  # late steps, a deadline each, until it is lost
        assert proxy.propose(asks) == {}
        steps += 1
        assert steps < 10
    assert steps == 3 and proxy.stats.late == 3 and proxy.stats.failures == 1
    # Lost: a step starts a reconnection and returns at once, while it hangs.
    started = time.monotonic()
    for _ in range(3):
        assert proxy.propose(asks) == {}
    assert time.monotonic() - started < 0.05
    assert proxy.opened == 2  # one attempt in flight, not one a step
    proxy.let_through.set()
    assert proxy._reconnecting is not None
    proxy._reconnecting.join(5)
    assert proxy.submit(asks) is not None  # the new connection, taken up by the step
    assert proxy._incarnation == 2 and proxy.stats.reconnects == 1
    channel = proxy._channel
    assert isinstance(channel, _SilentChannel) and channel.sent == 1


class _Recorder:
    """A channel and link that keep what is sent (no reply is asked for here)."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.features: list[torch.Tensor] = []

    def request(self, payload: Any) -> int:
        self.messages.append(payload)
        return len(self.messages)

    def send(self, tensor: torch.Tensor, wait: bool = True) -> None:
        self.features.append(tensor)

    def close(self) -> None:
        pass


class _LazyProxy(RemoteDrafter):
    """A proxy that connects when its first sequence arrives; each connection waits until let
    through."""

    def __init__(self) -> None:
        self.opened = 0
        self.let_through = threading.Event()
        self.wire = _Recorder()
        super().__init__(actor=None, method="eagle", name="drafter-test", connect=False)

    def _open(self) -> _Connection:
        self.opened += 1
        assert self.let_through.wait(10)
        return _Connection(link=self.wire, channel=self.wire, incarnation=self.opened)  # type: ignore[arg-type]


@pytest.mark.parametrize("in_time", [True, False])
def test_a_lazy_proxy_connects_on_its_first_sequence_and_keeps_what_came_meanwhile(
    monkeypatch: pytest.MonkeyPatch, in_time: bool
) -> None:
    """Built with `connect=False`, nothing is opened until a sequence arrives; then the
    connection is made off the engine's thread, and the steps meanwhile neither wait nor lose
    the sequence's events and features: they go with the first message. A first connection
    slower than `LOST_AFTER_S` is a reconnection: the buffer goes, and every live sequence is
    re-added with its whole history."""
    monkeypatch.setattr(remote_drafting, "LOST_AFTER_S", 10.0 if in_time else 0.0)
    monkeypatch.setattr(remote_drafting, "RECONNECT_EVERY_S", 0.0)
    proxy = _LazyProxy()
    assert proxy.opened == 0 and proxy._reconnecting is None
    proxy.add("r1", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    proxy.observe_hidden("r1", 0, torch.ones(3, 4))
    proxy.commit("r1", [7])
    asks = [DraftRequest("r1", 4, 4)]
    started = time.monotonic()
    assert proxy.propose(asks) == {}  # still connecting: no drafts, no wait
    assert time.monotonic() - started < 0.05 and proxy.opened == 1
    proxy.let_through.set()
    assert proxy._reconnecting is not None
    proxy._reconnecting.join(5)
    assert proxy.submit(asks) is not None
    (message,) = proxy.wire.messages
    assert message.incarnation == 1 and message.requests == asks
    if in_time:
        assert [e[0] for e in message.events] == ["add", "features", "commit"]
        assert message.feature_rows == 3 and len(proxy.wire.features) == 1
        assert proxy.stats.reconnects == 0
    else:
        assert message.events == [("add", "r1", [1, 2, 3, 7], message.events[0][3])]
        assert message.feature_rows == 0 and proxy.wire.features == []
        assert proxy.stats.reconnects == 1
