"""Fair share inside the engine: who is admitted next, who a step serves, who is preempted.

Requests belong to tenants (an API key, or whatever the router names: `Share.tenant`), each
with a weight, and carry a priority (lower first, vLLM's meaning). The scheduler
(workers/engine/scheduler.py) asks this:

- **Admission** goes by priority, then by each tenant's virtual time (weighted fair queuing over
  tokens: a tenant's virtual time grows by the tokens its sequences are given in a step over its
  weight), then by arrival. So a key with a long queue cannot hold the step budget while another
  waits: the other's next request is admitted as soon as its virtual time is the least. A tenant
  that was idle rejoins at the least virtual time among those active: an idle spell carries
  neither credit nor debt (start-time fair queuing's rule: a flow's service while the others
  wanted none is not held against it, nor its absence for it).
- **A step's share**: while another tenant waits, a tenant holding more than `max_step_share`
  of the running places (`max_num_seqs`), scaled by its weight against the others', yields
  one (its newest, least urgent sequence is preempted) so that the other is admitted at once;
  and while more than one tenant runs, no tenant's sequences fill more than that share of a
  step's places: its others sit the step out, the least recently served going first next
  time. A flooder's batch then shares each step with the others instead of filling it.
- **Arrivals first**: a request of a tenant with nothing running, at least as urgent as every
  running sequence, arriving while other tenants run, has its prefill in a step of its own
  (with the other arrivals of that kind), as SGLang runs a prefill batch before decoding: its
  first token waits for its own prefill, not for a step that also decodes the others' batch.
  A step of the others under way when it comes is given up between two layers where it can
  be (workers/engine/step_interrupt.py: nothing of it committed, it runs again after), so it
  does not wait for that either. Never two such steps in a row, so the others' decoding goes
  on between arrivals.
- **Preemption**: where a waiting request of a more urgent priority finds no room, the least
  urgent running sequence (the newest of those) is preempted; preemption and the continuation
  are exact, so its text is that of an uninterrupted run. Out of KV blocks, the victim is
  likewise the least urgent, newest sequence.

With one tenant and one priority (the default) every choice is first come, first served, as
before.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.sequence import Sequence

MIN_WEIGHT, MAX_WEIGHT = 0.01, 100.0
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000


@dataclass(frozen=True, slots=True)
class Share:
    """A request's place in the engine's fair share."""

    tenant: str = ""  # whose request ("": everyone's, one tenant)
    weight: float = 1.0  # the tenant's share against the others'
    priority: int = 0  # lower runs first

    def __post_init__(self) -> None:
        if not MIN_WEIGHT <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight must be in {MIN_WEIGHT}..{MAX_WEIGHT}, got {self.weight}")
        if not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(
                f"priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {self.priority}"
            )


DEFAULT_SHARE = Share()


@dataclass(slots=True)
class FairShare:
    """The tenants' virtual times and the choices made from them (module docstring)."""

    max_step_share: float = 0.5  # of a step's places one tenant may fill while others wait
    vtime: dict[str, float] = field(default_factory=dict)
    step: int = 0  # steps scheduled, for "least recently served"
    last_served: dict[str, int] = field(default_factory=dict)  # request id -> step
    arrival_step: int = -1  # the last step that admitted arrivals alone

    def charge(self, seq: Sequence, tokens: int) -> None:
        """The sequence's tenant was given `tokens` in this step."""
        share = seq.share
        self.vtime[share.tenant] = self.vtime.get(share.tenant, 0.0) + tokens / share.weight
        self.last_served[seq.request_id] = self.step

    def refund(self, seq: Sequence, tokens: int) -> None:
        """`charge` taken back: the step that gave the tokens was given up."""
        share = seq.share
        self.vtime[share.tenant] = self.vtime.get(share.tenant, 0.0) - tokens / share.weight

    def join(self, seq: Sequence, active: Iterable[Sequence]) -> None:
        """A request arrives: a tenant without unfinished requests starts at the least virtual
        time among the tenants with some, whether it had been served more or less than they
        while it was idle (the first to arrive at an idle engine keeps its own: there is no one
        to measure it against, and the next to come is measured against it)."""
        tenant = seq.share.tenant
        busy = {s.share.tenant for s in active}
        if tenant in busy:
            return
        floor = min((self.vtime.get(t, 0.0) for t in busy), default=None)
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) if floor is None else floor

    def forget(self, seq: Sequence) -> None:
        self.last_served.pop(seq.request_id, None)

    def next_waiting(
        self, waiting: Iterable[Sequence], running: Iterable[Sequence] = ()
    ) -> Sequence | None:
        """The waiting sequence to admit next: the most urgent, then the tenant furthest
        behind (its virtual time), then the tenant holding fewer running places (a tenant that
        just joined, at the others' virtual time), then the oldest."""
        held = Counter(s.share.tenant for s in running)

        def key(seq: Sequence) -> tuple[int, float, int, int]:
            tenant = seq.share.tenant
            return (seq.share.priority, self.vtime.get(tenant, 0.0), held[tenant], seq.arrival)

        return min(waiting, key=key, default=None)

    @property
    def capped(self) -> bool:
        """Whether a step's share is capped (`max_step_share` under 1); without the cap there
        are no steps of their own for arrivals either."""
        return self.max_step_share < 1.0

    def arrivals(self, waiting: Iterable[Sequence], running: list[Sequence]) -> set[int]:
        """The waiting sequences (their ids) to admit in a step of their own: those of tenants
        with nothing running, as urgent as any running sequence, while other tenants run
        (none where the last step was such a step, or where the share cap is off)."""
        if not running or not self.capped or self.arrival_step == self.step:
            return set()
        first = self.comes_first(running)
        return {id(s) for s in waiting if first(s.share)}

    @staticmethod
    def comes_first(running: Iterable[Sequence]) -> Callable[[Share], bool]:
        """Whether a request of a share, arriving beside `running` (not empty), has its prefill
        in a step of its own: its tenant has nothing running, and it is as urgent as the most
        urgent running sequence."""
        shares = [s.share for s in running]
        busy = {share.tenant for share in shares}
        urgent = min(share.priority for share in shares)
        return lambda share: share.tenant not in busy and share.priority <= urgent

    def arrivals_alone(self) -> None:
        """This step admits arrivals alone (`arrivals`): the next one may not."""
        self.step += 1
        self.arrival_step = self.step

    def step_order(self, running: list[Sequence], max_num_seqs: int) -> list[Sequence]:
        """The running sequences this step serves, in the running list's order: all of them,
        unless several tenants are active, when each tenant keeps at most its cap (`places`) of
        the step's places (its least recently served first)."""
        self.step += 1
        tenants = {s.share.tenant for s in running}
        if len(tenants) < 2 or not self.capped:
            return list(running)
        caps = self.places(running, max_num_seqs)
        chosen: set[int] = set()
        for tenant in tenants:
            mine = [s for s in running if s.share.tenant == tenant]
            if len(mine) > caps[tenant]:
                mine.sort(key=lambda s: (s.share.priority, self.last_served.get(s.request_id, -1)))
                mine = mine[: caps[tenant]]
            chosen.update(id(s) for s in mine)
        return [s for s in running if id(s) in chosen]

    def places(self, seqs: Iterable[Sequence], max_num_seqs: int) -> dict[str, int]:
        """The most of a step's places each tenant of `seqs` may fill: `max_step_share` of
        them, scaled by its weight against the mean weight of these tenants (of two tenants
        of weights 3 and 1 at the default half, three quarters and one quarter)."""
        weights = {s.share.tenant: s.share.weight for s in seqs}
        mean = sum(weights.values()) / len(weights)
        return {
            tenant: min(
                max_num_seqs, max(1, math.floor(self.max_step_share * max_num_seqs * w / mean))
            )
            for tenant, w in weights.items()
        }

    @staticmethod
    def victim(running: list[Sequence]) -> Sequence:
        """The running sequence to preempt: the least urgent, and of those the newest."""
        return max(running, key=lambda s: (s.share.priority, s.arrival))

    def preempts_for(
        self, seq: Sequence, running: list[Sequence], max_num_seqs: int
    ) -> Sequence | None:
        """A running sequence to preempt to make room for `seq` (None: none yields): a less
        urgent one, or one of a tenant holding more than its share of the places while
        `seq`'s tenant waits (of `seq`'s urgency or less)."""
        if not running:
            return None
        victim = self.victim(running)
        if victim.share.priority > seq.share.priority:
            return victim
        if not self.capped:
            return None
        caps = self.places([*running, seq], max_num_seqs)
        held = Counter(s.share.tenant for s in running)
        over = [
            s
            for s in running
            if s.share.tenant != seq.share.tenant
            and held[s.share.tenant] > caps[s.share.tenant]
            and s.share.priority >= seq.share.priority
        ]
        return self.victim(over) if over else None
