"""Drafters in their own actors, from the verifier's side (the actor's side is
cluster/drafter_worker.py).

`RemoteDrafter` is a `Drafter` inside the verifier's engine. It buffers what the engine tells
it (sequences added and removed, features, commits) and sends all of it with the next proposal
in one message per step (`DrafterWorker.step`) over the pair's step channel (cluster/
step_channel.py: a TCP connection the drafter's thread waits on, set up by a Ray call; a Ray
call per step would cost 2-3 ms on a busy node). The feature rows of that step travel as one
tensor over the pair's `TensorLink`, never through the object store. The proposal is awaited for
at most `deadline_s`: a late or failed drafter means k = 0 for its sequences this step (the
engine verifies without drafts), never a stalled verifier; a late reply is dropped when it
comes. `ShardedDrafter` puts several drafter actors of one method behind one `Drafter`.

A drafter that died (its actor restarted by Ray, or replaced) comes back empty. The proxy notices
(a broken channel, or the restarted actor's new incarnation number), rebuilds the link and the
channel and re-adds every live sequence with its whole token history; a feature-reading drafter
then starts its context at the next features it gets. Output stays exactly the target's either
way: drafts only ever change speed.

A drafter that stops answering without closing anything (its host cut off, or hung) is taken
for lost once its replies have been late for `LOST_AFTER_S` in all since its last answer, so
a partition costs the verifier's streams about that long once, not a deadline every step. The
connection is rebuilt on a thread of its own (`RECONNECT_EVERY_S` apart): building it waits on
Ray and on the link's timeout, which the engine's thread must never do. Until it is back the
engine verifies without drafts.

A proxy made with `connect=False` opens its connection when its first sequence arrives, on that
same thread, and keeps what the engine tells it meanwhile (at most `LOST_AFTER_S`), so the
first request loses no features. A verifier does that for a pool its default method does not
use (`make serve`'s: n-gram drafts in the verifier, the EAGLE pool for requests that ask): an
open link's two gloo threads each wake ten times a second, on cores the engine shares.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from cluster.drafter_worker import DraftReply, DraftStep, Handshake
from cluster.links import LinkError, TensorLink
from cluster.step_channel import ChannelError, ChannelTimeout, Failure, StepClient
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.engine.sampling_params import SamplingParams

MAX_SERVED_RECORDS = 10_000
LOST_AFTER_S = 2.0  # late replies for this long in all since the last answer: the drafter is lost
RECONNECT_EVERY_S = 1.0  # between attempts to rebuild a lost drafter's connection
log = logging.getLogger(__name__)


class ShardedDrafter(Drafter):
    """Several drafter actors of one method behind one `Drafter`: each sequence sticks to the
    shard that had the fewest sequences when it arrived; a step asks every shard at once and
    waits for all of them until one shared deadline."""

    def __init__(self, shards: Sequence[RemoteDrafter]) -> None:
        if not shards:
            raise ValueError("a sharded drafter needs at least one shard")
        self.shards = list(shards)
        self.method = shards[0].method
        self.hidden_layers = shards[0].hidden_layers
        self.drafts_trees = all(s.drafts_trees for s in shards)
        measured = [s.tree_seconds for s in shards if s.tree_seconds is not None]
        self.tree_seconds = max(measured) if measured else None
        self._owner: dict[str, RemoteDrafter] = {}
        self._served: dict[str, str] = {}  # request -> shard name, kept until asked for

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        load = {id(s): 0 for s in self.shards}
        for shard in self._owner.values():
            load[id(shard)] += 1
        shard = min(self.shards, key=lambda s: load[id(s)])
        self._owner[request_id] = shard
        self._served[request_id] = shard.name
        if len(self._served) > MAX_SERVED_RECORDS:  # aborted requests are never asked about
            del self._served[next(iter(self._served))]
        shard.add(request_id, prompt_token_ids, params)

    def observe_hidden(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        self._owner[request_id].observe_hidden(request_id, first_position, hidden)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._owner[request_id].commit(request_id, token_ids)

    def owner_name(self, request_id: str) -> str | None:
        """The shard that drafted for the request (once: the record is dropped)."""
        return self._served.pop(request_id, None)

    def remove(self, request_id: str) -> None:
        shard = self._owner.pop(request_id, None)
        if shard is not None:
            shard.remove(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        by_shard: dict[int, list[DraftRequest]] = {id(s): [] for s in self.shards}
        for req in requests:
            by_shard[id(self._owner[req.request_id])].append(req)
        # Shards with nothing to draft still get their buffered events (features pile up else).
        pending = [
            (s, s.submit(by_shard[id(s)])) for s in self.shards if by_shard[id(s)] or s.has_events
        ]
        deadline = time.monotonic() + max(s.deadline_s for s in self.shards)
        drafts: dict[str, Draft] = {}
        for shard, seq in pending:
            drafts.update(shard.collect(seq, deadline))
        return drafts

    @property
    def stats(self) -> RemoteStats:
        total = RemoteStats()
        for shard in self.shards:
            for f in fields(RemoteStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(shard.stats, f.name))
        return total


@dataclass(slots=True)
class _Tracked:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # committed output


@dataclass(frozen=True, slots=True)
class _Connection:
    link: TensorLink
    channel: StepClient
    incarnation: int


@dataclass(slots=True)
class RemoteStats:
    steps: int = 0
    late: int = 0  # proposals that missed the deadline
    failures: int = 0  # calls that raised (a dead or restarted drafter)
    reconnects: int = 0
    feature_bytes: int = 0
    ahead_served: int = 0  # proposals the drafter had drafted ahead
    ahead_kept_going: int = 0  # steps answered while its drafting ahead went on
    trees: int = 0  # draft trees received (speculative.tree_nodes)
    draft_s: float = 0.0  # drafting inside the actor, over answered steps
    handled_s: float = 0.0  # the actor's whole calls (drafting included), over answered steps
    wait_s: float = 0.0  # the verifier's wait from sending a step to its drafts, over all steps


class RemoteDrafter(Drafter):
    """A `Drafter` whose work happens in a `DrafterWorker` actor."""

    def __init__(
        self,
        actor: Any,
        method: str,
        hidden_layers: Sequence[int] = (),
        deadline_s: float = 1.0,
        name: str = "drafter",
        backend: str = "gloo",  # the link's: NCCL where both ends are on GPUs (link_backend)
        connect: bool = True,  # now; else when the first sequence arrives
    ) -> None:
        self.actor = actor
        self.name = name
        self.backend = backend
        self.method = method
        self.hidden_layers = tuple(hidden_layers)
        self.deadline_s = deadline_s
        self.stats = RemoteStats()
        self._events: list[Any] = []
        self._features: list[torch.Tensor] = []
        self._seqs: dict[str, _Tracked] = {}
        self._link: TensorLink | None = None
        self._channel: StepClient | None = None
        self._incarnation: int | None = None
        self._late_s = 0.0  # waited in vain since the last reply
        self._reconnecting: threading.Thread | None = None
        self._made: _Connection | None = None  # a reconnection's, until the engine takes it
        self._next_attempt = 0.0
        self._first: float | None = None  # the first connection's buffering ends by then
        if connect:
            self._install(self._open())

    # -- the Drafter boundary, buffered --------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._seqs[request_id] = _Tracked(list(prompt_token_ids), params)
        self._events.append(("add", request_id, list(prompt_token_ids), params))
        if self._channel is None and self._reconnecting is None:  # the first sequence
            self._first = time.monotonic() + LOST_AFTER_S
            self._start_attempt()

    def observe_hidden(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        self._events.append(("features", request_id, first_position, hidden.shape[0]))
        self._features.append(hidden)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._seqs[request_id].tokens += token_ids
        self._events.append(("commit", request_id, list(token_ids)))

    def remove(self, request_id: str) -> None:
        if self._seqs.pop(request_id, None) is not None:
            self._events.append(("remove", request_id))

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        return self.collect(self.submit(requests))

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def submit(self, requests: Sequence[DraftRequest]) -> int | None:
        """Send this step's events and requests; returns the message's sequence number for
        `collect` (None when the drafter is down)."""
        if self._incarnation is None and not self._reconnected():
            if self._first is None:  # down: its state is rebuilt when it is back
                self._drop_buffer()
            return None
        message = DraftStep(self._incarnation or 0, self._events, list(requests))
        features = torch.cat(self._features) if self._features else None
        if features is not None:
            message.feature_rows, message.feature_width = features.shape
            message.feature_dtype = str(features.dtype).removeprefix("torch.")
        self._drop_buffer()
        self.stats.steps += 1
        assert self._channel is not None and self._link is not None
        try:
            seq = self._channel.request(message)
            if features is not None:
                self._link.send(features, wait=False)
                self.stats.feature_bytes += features.numel() * features.element_size()
        except (ChannelError, LinkError):
            self._lost()
            return None
        return seq

    def collect(self, seq: int | None, deadline: float | None = None) -> dict[str, Draft]:
        """The drafts of a `submit`, waiting until `deadline` (a `time.monotonic()` value;
        default: `deadline_s` from now). Late or failed: no drafts."""
        if seq is None or self._channel is None:
            return {}
        if deadline is None:
            deadline = time.monotonic() + self.deadline_s
        start = time.perf_counter()
        try:
            reply: DraftReply | Failure = self._channel.reply(seq, deadline)
        except ChannelTimeout:
            self.stats.late += 1
            self._late_s += time.perf_counter() - start
            if self._late_s >= LOST_AFTER_S:
                log.warning(
                    "%s: no answer for %.1f s; drafting without it", self.name, self._late_s
                )
                self._lost()
            return {}
        except ChannelError:
            self._lost()
            return {}
        finally:
            self.stats.wait_s += time.perf_counter() - start
        self._late_s = 0.0
        if isinstance(reply, Failure):  # e.g. DrafterRestarted, or its link broke
            log.warning("%s: step failed: %s: %s", self.name, reply.kind, reply.message)
            self._lost()
            return {}
        self.stats.ahead_served += reply.ahead_served
        self.stats.ahead_kept_going += reply.kept_going
        self.stats.draft_s += reply.seconds
        self.stats.handled_s += reply.handled_s
        drafts = {rid: Draft(*f) for rid, f in reply.drafts.items() if rid in self._seqs}
        self.stats.trees += sum(d.parents is not None for d in drafts.values())
        return drafts

    def _lost(self) -> None:
        """The drafter failed, restarted or went silent: reconnect and re-add everything."""
        self.stats.failures += 1
        self._incarnation = None
        self._late_s = 0.0

    # -- connection ----------------------------------------------------------------------------

    def _open(self) -> _Connection:
        """A new link and step channel to the actor (waits on Ray and on the link)."""
        import ray

        link = TensorLink.host(f"{self.name}-{time.time_ns()}", self.backend)
        joined = self.actor.open_link.remote(link.address)
        link.connect_racing(joined)  # collective with the actor's join
        handshake: Handshake = ray.get(joined, timeout=30)
        return _Connection(link, StepClient(handshake.channel), handshake.incarnation)

    def _install(self, made: _Connection) -> None:
        if self._channel is not None:
            self._channel.close()
        self._link, self._channel, self._incarnation = made.link, made.channel, made.incarnation

    def _reconnected(self) -> bool:
        """Whether a connection made on the connecting thread is now in place (then every live
        sequence is re-added, but for a first connection in time, which the buffer holds it
        all for); else an attempt is started when none runs and the last was
        `RECONNECT_EVERY_S` ago. Never waits."""
        # Whether an attempt runs is read first: one that ends meanwhile has set `_made` by then.
        running = self._reconnecting is not None and self._reconnecting.is_alive()
        made, self._made = self._made, None
        if made is None:
            if self._first is not None and (not running or time.monotonic() > self._first):
                self._first = None  # the first connection failed or is slow: drop what waits
            if not running and time.monotonic() >= self._next_attempt:
                self._start_attempt()
            return False
        self._install(made)
        if self._first is not None:  # the first connection: what the buffer holds is all
            self._first = None
            return True
        self.stats.reconnects += 1
        self._drop_buffer()
        for rid, seq in self._seqs.items():
            self._events.append(("add", rid, seq.prompt + seq.tokens, seq.params))
        return True

    def _start_attempt(self) -> None:
        self._next_attempt = time.monotonic() + RECONNECT_EVERY_S
        self._reconnecting = threading.Thread(
            target=self._attempt, name=f"connect-{self.name}", daemon=True
        )
        self._reconnecting.start()

    def _attempt(self) -> None:
        try:
            self._made = self._open()
        except Exception as err:  # still down: the next step starts another attempt
            log.info("%s: connecting failed: %s: %s", self.name, type(err).__name__, err)

    def _drop_buffer(self) -> None:
        self._events, self._features = [], []
