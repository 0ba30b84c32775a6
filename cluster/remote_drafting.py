"""Drafters in their own actors: the verifier's proxy and the drafter actor's side.

`RemoteDrafter` is a `Drafter` inside the verifier's engine. It buffers what the engine tells
it (sequences added and removed, features, commits) and sends all of it with the next proposal
in one message per step (`DrafterWorker.step`) over the pair's step channel (cluster/
step_channel.py: a TCP connection the drafter's thread waits on, set up by a Ray call; a Ray
call per step would cost 2-3 ms on a busy node). The feature rows of that step travel as one
tensor over the pair's `TensorLink`, never through the object store. The proposal is awaited for
at most `deadline_s`: a late or failed drafter means k = 0 for its sequences this step (the
engine verifies without drafts), never a stalled verifier; a late reply is dropped when it
comes.

While the verifier checks a proposal, a drafter that can (`Drafter.drafts_ahead`: the model
drafters) prepares the next one on a thread of its actor, guessing that the whole draft is
accepted (workers/drafting/base.py); the next call stops that thread and waits for it, and a
right guess is answered without drafting. The thread ends at its next forward where a commit in
the call may be its guess, and between two layers of the forward under way where none can be
(a draft model's forward costs the verifier a third of its own, and half of that, on average,
is what finishing it would add to the step). The drafter's core would idle otherwise. A drafter
that `keeps_drafting_ahead` (the draft model) is not stopped by a call that only commits the
guesses of the sequences it asks for: that call is answered from the chains drafted so far while
drafting ahead goes on (`Drafter.take_ahead`), and waits at most for the forward under way where
a chain holds no draft token yet.

A drafter that died (its actor restarted by Ray, or replaced) comes back empty. The proxy notices
(a broken channel, or the restarted actor's new incarnation number), rebuilds the link and the
channel and re-adds
every live sequence with its whole token history; a feature-reading drafter then starts its
context at the next features it gets. Output stays exactly the target's either way: drafts only
ever change speed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from cluster.links import LinkAddress, LinkError, TensorLink
from cluster.step_channel import (
    ChannelAddress,
    ChannelError,
    ChannelTimeout,
    Failure,
    StepClient,
    StepServer,
)
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.engine.sampling_params import SamplingParams

MAX_SERVED_RECORDS = 10_000
# The longest a step served from drafting ahead that goes on waits for the forward under way
# (its guess or first draft token) before taking the usual path; a forward takes far less.
TAKE_AHEAD_WAIT_S = 0.5
log = logging.getLogger(__name__)

# Events, in the order the engine produced them (per sequence that order matters).
Event = (
    tuple[str, str, list[int], SamplingParams]  # ("add", rid, prompt, params)
    | tuple[str, str, int, int]  # ("features", rid, first_position, rows)
    | tuple[str, str, list[int]]  # ("commit", rid, token_ids)
    | tuple[str, str]  # ("remove", rid)
)


@dataclass(slots=True)
class StepMessage:
    """One step's traffic to a drafter (plain data; feature rows follow over the link)."""

    incarnation: int  # which life of the drafter actor this state belongs to
    events: list[Any]
    requests: list[DraftRequest]
    feature_rows: int = 0
    feature_width: int = 0
    feature_dtype: str = "float32"


@dataclass(slots=True)
class DraftReply:
    drafts: dict[str, tuple[list[int], torch.Tensor | None]]
    seconds: float  # drafting time inside the actor
    ahead_served: int = 0  # proposals of this step that were drafted ahead
    kept_going: bool = False  # served while drafting ahead went on (take_ahead)
    handled_s: float = 0.0  # the whole step inside the actor: events, features, drafting


@dataclass(frozen=True, slots=True)
class Handshake:
    """The drafter's answer to `open_link`: which life of the actor this is, and where its step
    channel listens (with the token for one connection)."""

    incarnation: int
    channel: ChannelAddress


class DrafterWorker:
    """The drafter actor's state: one `Drafter`, the link its features arrive on and the step
    channel its verifier's messages arrive on."""

    def __init__(
        self,
        make_drafter: Callable[[], Drafter],
        name: str,
        draft_ahead: bool = True,
        keep_going: bool = True,
    ) -> None:
        self.drafter = make_drafter()
        self.name = name
        self.draft_ahead = draft_ahead and self.drafter.drafts_ahead
        self.keep_going = keep_going and self.draft_ahead and self.drafter.keeps_drafting_ahead
        self.link: TensorLink | None = None
        self.channel: StepServer | None = None  # opened with the first link
        self.incarnation = int(time.time_ns())  # a restarted actor gets a new one
        self._ahead: threading.Thread | None = None
        self._stop_ahead = threading.Event()
        self._abandon_ahead = threading.Event()

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.drafter.method,
            "hidden_layers": list(self.drafter.hidden_layers),
            "incarnation": self.incarnation,
            "draft_ahead": self.draft_ahead,
            "keep_drafting_ahead": self.keep_going,
        }

    def open_link(self, address: LinkAddress) -> Handshake:
        self.link = TensorLink.join(address)
        if self.channel is None:
            self.channel = StepServer(self.step, f"{self.name}-steps")
        return Handshake(self.incarnation, self.channel.address())

    def step(self, message: StepMessage) -> DraftReply:
        entered = time.perf_counter()
        reply = self._step(message)
        reply.handled_s = time.perf_counter() - entered
        return reply

    def _step(self, message: StepMessage) -> DraftReply:
        taken = self._take_ahead(message)
        if taken is not None:
            return taken
        self._finish_ahead(abandon=not self.guess_may_hold(message.events))
        if message.incarnation != self.incarnation:
            raise DrafterRestarted(f"{self.name} restarted; the verifier must re-add its sequences")
        features = None
        if message.feature_rows:
            if self.link is None:
                raise LinkError(f"{self.name} has no link for features")
            dtype = getattr(torch, message.feature_dtype)
            features = self.link.recv((message.feature_rows, message.feature_width), dtype)
        offset = 0
        for event in message.events:
            kind, rid = event[0], event[1]
            if kind == "add":
                self.drafter.add(rid, event[2], event[3])
            elif kind == "features":
                assert features is not None
                first, rows = event[2], event[3]
                self.drafter.observe_hidden(rid, first, features[offset : offset + rows])
                offset += rows
            elif kind == "commit":
                self.drafter.commit(rid, event[2])
            elif kind == "remove":
                self.drafter.remove(rid)
        start = time.perf_counter()
        served = self.drafter.ahead_served
        drafts = self.drafter.propose(message.requests) if message.requests else {}
        reply = DraftReply(
            {rid: (d.token_ids, d.probs) for rid, d in drafts.items()},
            time.perf_counter() - start,
            self.drafter.ahead_served - served,
        )
        if self.draft_ahead and drafts:
            self._ahead = threading.Thread(
                target=self._draft_ahead, args=(message.requests,), name="draft-ahead"
            )
            self._ahead.start()
        return reply

    def _take_ahead(self, message: StepMessage) -> DraftReply | None:
        """Answer a step from drafting ahead that goes on, when it only commits (once per
        sequence, and for just the sequences it asks drafts of) and the commits are the
        guesses; None otherwise."""
        if not (self.keep_going and self._ahead is not None and self._ahead.is_alive()):
            return None
        if message.incarnation != self.incarnation or message.feature_rows:
            return None
        commits: dict[str, list[int]] = {}
        for event in message.events:
            if event[0] != "commit" or event[1] in commits:
                return None
            commits[event[1]] = event[2]
        start = time.perf_counter()
        drafts = self.drafter.take_ahead(commits, message.requests, TAKE_AHEAD_WAIT_S)
        if drafts is None:
            return None
        return DraftReply(
            {rid: (d.token_ids, d.probs) for rid, d in drafts.items()},
            time.perf_counter() - start,
            ahead_served=sum(bool(d.token_ids) for d in drafts.values()),
            kept_going=True,
        )

    def guess_may_hold(self, events: list[Any]) -> bool:
        """Whether the first commit of some sequence in `events` may be what drafting ahead
        guessed (so the forward under way is worth finishing)."""
        first: dict[str, list[int]] = {}
        for event in events:
            if event[0] == "commit":
                first.setdefault(event[1], event[2])
        return any(self.drafter.ahead_may_hold(rid, tokens) for rid, tokens in first.items())

    def _draft_ahead(self, requests: list[DraftRequest]) -> None:
        try:
            self.drafter.draft_ahead(
                requests, self._stop_ahead.is_set, self._abandon_ahead.is_set, self.keep_going
            )
        except Exception:  # a lost guess costs nothing; the next proposal drafts afresh
            log.exception("%s: drafting ahead failed", self.name)

    def _finish_ahead(self, abandon: bool) -> None:
        """Stop drafting ahead (at its next forward, or with `abandon` inside the one under way)
        and wait for it."""
        if self._ahead is not None:
            if abandon:
                self._abandon_ahead.set()
            self._stop_ahead.set()
            self.drafter.wake_ahead()
            self._ahead.join()
            self._ahead = None
            self._stop_ahead.clear()
            self._abandon_ahead.clear()


class DrafterRestarted(RuntimeError):
    """The drafter lost its state; its verifier re-adds every sequence."""


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


@dataclass(slots=True)
class RemoteStats:
    steps: int = 0
    late: int = 0  # proposals that missed the deadline
    failures: int = 0  # calls that raised (a dead or restarted drafter)
    reconnects: int = 0
    feature_bytes: int = 0
    ahead_served: int = 0  # proposals the drafter had drafted ahead
    ahead_kept_going: int = 0  # steps answered while its drafting ahead went on
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
        self._connect()

    # -- the Drafter boundary, buffered --------------------------------------------------------

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._seqs[request_id] = _Tracked(list(prompt_token_ids), params)
        self._events.append(("add", request_id, list(prompt_token_ids), params))

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
        if self._incarnation is None and not self._reconnect():
            self._drop_buffer()  # the drafter is down; its state is rebuilt when it is back
            return None
        message = StepMessage(self._incarnation or 0, self._events, list(requests))
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
            return {}
        except ChannelError:
            self._lost()
            return {}
        finally:
            self.stats.wait_s += time.perf_counter() - start
        if isinstance(reply, Failure):  # e.g. DrafterRestarted, or its link broke
            log.warning("%s: step failed: %s: %s", self.name, reply.kind, reply.message)
            self._lost()
            return {}
        self.stats.ahead_served += reply.ahead_served
        self.stats.ahead_kept_going += reply.kept_going
        self.stats.draft_s += reply.seconds
        self.stats.handled_s += reply.handled_s
        return {
            rid: Draft(tokens, probs)
            for rid, (tokens, probs) in reply.drafts.items()
            if rid in self._seqs
        }

    def _lost(self) -> None:
        """The drafter failed or restarted: reconnect and re-add everything before next time."""
        self.stats.failures += 1
        self._incarnation = None

    # -- connection ----------------------------------------------------------------------------

    def _connect(self) -> None:
        import ray

        link = TensorLink.host(f"{self.name}-{time.time_ns()}", self.backend)
        joined = self.actor.open_link.remote(link.address)
        link.connect()  # collective with the actor's join
        handshake: Handshake = ray.get(joined, timeout=30)
        if self._channel is not None:
            self._channel.close()
        self._channel = StepClient(handshake.channel)
        self._incarnation = handshake.incarnation
        self._link = link

    def _reconnect(self) -> bool:
        """After a failure: rebuild the link and re-add every live sequence."""
        try:
            self._connect()
        except Exception:
            return False
        self.stats.reconnects += 1
        self._drop_buffer()
        for rid, seq in self._seqs.items():
            self._events.append(("add", rid, seq.prompt + seq.tokens, seq.params))
        return True

    def _drop_buffer(self) -> None:
        self._events, self._features = [], []
