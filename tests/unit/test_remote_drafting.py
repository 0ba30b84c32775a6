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
