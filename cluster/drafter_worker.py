"""The drafter actor's side of remote drafting: a `Drafter` behind the verifier's step messages.

`DrafterWorker.step` takes one step's message from the verifier (cluster/remote_drafting.py
`RemoteDrafter` sends it over the pair's step channel, cluster/step_channel.py): the events since
the last step (sequences added and removed, commits, which feature rows follow over the pair's
`TensorLink`) and the step's draft requests; it applies them in order and answers with the
drafts.

While the verifier checks a proposal, a drafter that can (`Drafter.drafts_ahead`: the model
drafters) prepares the next one on a thread of its actor, guessing that the whole draft is
accepted (workers/drafting/base.py); the next step stops that thread and waits for it, and a
right guess is answered without drafting. The thread ends at its next forward where a commit in
the step may be its guess, and between two layers of the forward under way where none can be
(a draft model's forward costs the verifier a third of its own, and half of that, on average,
is what finishing it would add to the step). The drafter's core would idle otherwise. A drafter
that `keeps_drafting_ahead` (the draft model) is not stopped by a step that only commits the
guesses of the sequences it asks for: that step is answered from the chains drafted so far while
drafting ahead goes on (`Drafter.take_ahead`), once each chain holds the whole draft an in-line
proposal would make.

Each link the verifier opens starts a new incarnation of the drafter's state: a restarted actor
comes back empty with one, and a verifier that reconnects (its channel broke, or it restarted
itself) gets one too. A step meant for an older incarnation raises `DrafterRestarted`, and the
verifier re-adds its sequences; the first step of a new incarnation drops whatever the drafter
still held from the one before, so a verifier that restarted leaves no sequences behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cluster.links import LinkAddress, LinkError, TensorLink
from cluster.step_channel import ChannelAddress, StepServer
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.engine.sampling_params import SamplingParams

# The longest a step served from drafting ahead that goes on waits for the chains to hold their
# whole drafts (k draft forwards at most); past it the step takes what they hold, or the usual
# path where a chain does not hold its guess yet.
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
class DraftStep:
    """One step's traffic to a drafter (plain data; feature rows follow over the link)."""

    incarnation: int  # which incarnation of the drafter's state (its latest link) this is for
    events: list[Any]
    requests: list[DraftRequest]
    feature_rows: int = 0
    feature_width: int = 0
    feature_dtype: str = "float32"


# A draft as it crosses to the verifier: its tokens, q, and a tree's parents and reach (base.py
# `Draft`).
DraftFields = tuple[
    list[int], torch.Tensor | None, tuple[int, ...] | None, tuple[float, ...] | None
]


def draft_fields(draft: Draft) -> DraftFields:
    return draft.token_ids, draft.probs, draft.parents, draft.reach


@dataclass(slots=True)
class DraftReply:
    drafts: dict[str, DraftFields]
    seconds: float  # drafting time inside the actor
    ahead_served: int = 0  # proposals of this step that were drafted ahead
    kept_going: bool = False  # served while drafting ahead went on (take_ahead)
    handled_s: float = 0.0  # the whole step inside the actor: events, features, drafting


@dataclass(frozen=True, slots=True)
class Handshake:
    """The drafter's answer to `open_link`: the incarnation of its state this link starts, and
    where its step channel listens (with the token for one connection)."""

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
        on_step: Callable[[DraftStep, DraftReply], None] | None = None,
    ) -> None:
        self.drafter = make_drafter()
        self._on_step = on_step  # sees every step answered (the actor's metrics)
        self.name = name
        self.draft_ahead = draft_ahead and self.drafter.drafts_ahead
        self.keep_going = keep_going and self.draft_ahead and self.drafter.keeps_drafting_ahead
        self.link: TensorLink | None = None
        self.channel: StepServer | None = None  # opened with the first link
        self.incarnation = time.time_ns()  # a restarted actor gets a new one; so does a link
        self._held = self.incarnation  # the incarnation the drafter's sequences belong to
        self._live: set[str] = set()  # those sequences
        self._ahead: threading.Thread | None = None
        self._stop_ahead = threading.Event()
        self._abandon_ahead = threading.Event()

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.drafter.method,
            "hidden_layers": list(self.drafter.hidden_layers),
            "drafts_trees": self.drafter.drafts_trees,
            "tree_seconds": self.drafter.tree_seconds,
            "incarnation": self.incarnation,
            "sequences": len(self._live),  # held for its verifier
            "draft_ahead": self.draft_ahead,
            "keep_drafting_ahead": self.keep_going,
        }

    def open_link(self, address: LinkAddress) -> Handshake:
        """A verifier's (new) link and step channel, and a new incarnation: the verifier adds
        every sequence it holds afresh."""
        self.link = TensorLink.join(address)
        if self.channel is None:
            self.channel = StepServer(self.step, f"{self.name}-steps")
        self.incarnation = max(time.time_ns(), self.incarnation + 1)
        return Handshake(self.incarnation, self.channel.address())

    def step(self, message: DraftStep) -> DraftReply:
        entered = time.perf_counter()
        reply = self._step(message)
        reply.handled_s = time.perf_counter() - entered
        if self._on_step is not None:
            self._on_step(message, reply)
        return reply

    def _step(self, message: DraftStep) -> DraftReply:
        taken = self._take_ahead(message)
        if taken is not None:
            return taken
        self._finish_ahead(abandon=not self.guess_may_hold(message.events))
        if message.incarnation != self.incarnation:
            raise DrafterRestarted(f"{self.name} restarted; the verifier must re-add its sequences")
        if self._held != self.incarnation:  # the first step since a new link
            for rid in self._live:
                self.drafter.remove(rid)
            self._live.clear()
            self._held = self.incarnation
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
                self._live.add(rid)
            elif kind == "features":
                assert features is not None
                first, rows = event[2], event[3]
                self.drafter.observe_hidden(rid, first, features[offset : offset + rows])
                offset += rows
            elif kind == "commit":
                self.drafter.commit(rid, event[2])
            elif kind == "remove":
                self.drafter.remove(rid)
                self._live.discard(rid)
        start = time.perf_counter()
        served = self.drafter.ahead_served
        drafts = self.drafter.propose(message.requests) if message.requests else {}
        reply = DraftReply(
            {rid: draft_fields(d) for rid, d in drafts.items()},
            time.perf_counter() - start,
            self.drafter.ahead_served - served,
        )
        if self.draft_ahead and drafts:
            self._ahead = threading.Thread(
                target=self._draft_ahead, args=(message.requests,), name="draft-ahead"
            )
            self._ahead.start()
        return reply

    def _take_ahead(self, message: DraftStep) -> DraftReply | None:
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
            {rid: draft_fields(d) for rid, d in drafts.items()},
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
