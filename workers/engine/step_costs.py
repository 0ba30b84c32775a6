"""What a verify step costs, in one-token target forwards, and the draft lengths that commit
the most tokens for it (the Speculator's adaptive k: workers/engine/speculator.py).

A step is one forward over every decoding sequence's last token and drafts, so its cost depends
on the batch's total: a forward over n new tokens costs verify(n) one-token forwards (measured at
start-up: workers/engine/calibration.py), plus its drafters' work and a fixed host overhead per
speculating sequence. A model drafter (a draft model, an EAGLE head) drafts the i-th token of
every sequence it serves in one batched forward, so a step pays for its method's longest draft,
a depth at the measured cost of drafting one token for one sequence (zero for n-gram drafters),
plus each further sequence's share of the depths it drafts at, where the drafter measured it
(`Drafter.row_seconds`: EAGLE's; on a GPU whose forwards are flat in rows it is small, on a CPU
or with per-row host work it is not). A drafter that measured no share is priced per token per
sequence. A draft its drafter makes without a forward (EAGLE's prompt lookup where the text
repeats) costs nothing but the overhead.

The host overhead is measured as served: drafting steps are timed against plain ones
(`StepCosts.observe`), which also gives the seconds a one-token forward's worth of a step takes.
"""

from __future__ import annotations

from collections.abc import Callable

# Drafting, rejection sampling and rollback are host work that a verify step does on top of its
# forward: a few percent of a one-token forward for the bundled model on a CPU. Charged to every
# step with k >= 1, it keeps marginal speculation (a gain of a few percent on paper) off.
SPEC_STEP_OVERHEAD = 0.05
# That overhead as served: drafting steps are timed against plain ones (`observe`) and the
# overhead a drafting sequence adds is followed by a running mean that weighs the newest step so
# (about the last 10 steps), between SPEC_STEP_OVERHEAD and MAX_SPEC_STEP_OVERHEAD. On a GPU,
# where a forward of a small model costs about what the host's drafting and verifying do, it is
# several times the CPU's share.
OVERHEAD_RATE = 0.1
MAX_SPEC_STEP_OVERHEAD = 2.0


class StepCosts:
    """The costs of a step in one-token target forwards, what is measured of them as served,
    and the draft lengths (`allocate`) that commit the most tokens for what they cost."""

    def __init__(
        self,
        verify_costs: tuple[float, ...] = (1.0,),
        draft_costs: dict[str, float] | None = None,
        draft_row_costs: dict[str, float] | None = None,
        draft_launch_costs: dict[str, float] | None = None,
        unit_seconds: float | None = None,
    ) -> None:
        self.verify_costs = verify_costs
        # A drafted token's cost in one-token target forwards, per method (0 when not listed):
        # one forward of its drafter for one sequence; and what each further sequence drafting
        # at that depth adds (not listed: as much again, a cost per token per sequence); and
        # what a step in which the method drafts pays once, whatever the depth (not listed: 0).
        self.draft_costs = dict(draft_costs or {})
        self.draft_row_costs = dict(draft_row_costs or {})
        self.draft_launch_costs = dict(draft_launch_costs or {})
        # What drafting and verifying add to a step for each drafting sequence, in one-token
        # forwards, as measured (`observe`); and the seconds a one-token forward's worth of a
        # plain step takes as served (the forward's own time until a plain step is timed).
        self.overhead = SPEC_STEP_OVERHEAD
        self.unit_seconds = unit_seconds

    def describe(self) -> str:
        """The draft costs, for the log."""
        return ", ".join(
            f"{m} {c:.3f} (+{self.row_cost(m):.3f} a further sequence, "
            f"+{self.draft_launch_costs.get(m, 0.0):.3f} a step)"
            for m, c in sorted(self.draft_costs.items())
        )

    def forward_cost(self, num_tokens: int) -> float:
        """A forward over `num_tokens` new tokens, in one-token forwards (beyond the measured
        range, in proportion to the longest measured forward)."""
        costs = self.verify_costs
        if num_tokens <= len(costs):
            return costs[max(num_tokens, 1) - 1]
        return costs[-1] * num_tokens / len(costs)

    def row_cost(self, method: str) -> float:
        """What one more sequence drafting at a depth adds to `method`'s forward there."""
        return self.draft_row_costs.get(method, self.draft_costs.get(method, 0.0))

    def step_cost(self, methods: list[str], ks: list[int]) -> float:
        """One step of a batch whose sequence i drafts ks[i] tokens with methods[i]: the forward
        over every sequence's token and drafts, each drafter's forwards (as many as its
        longest draft has tokens, each over every sequence still drafting, plus its launch),
        and the host overhead."""
        cost = self.forward_cost(len(ks) + sum(ks))
        depths: dict[str, int] = {}
        drafted: dict[str, int] = {}
        for method, k in zip(methods, ks, strict=True):
            if k:
                cost += self.overhead
                depths[method] = max(depths.get(method, 0), k)
                drafted[method] = drafted.get(method, 0) + k
        for method, depth in depths.items():
            # Each depth's forward for its first sequence, and every other draft token's share.
            cost += self.draft_launch_costs.get(method, 0.0)
            cost += depth * self.draft_costs.get(method, 0.0)
            cost += (drafted[method] - depth) * self.row_cost(method)
        return cost

    def observe(self, methods: list[str], ks: list[int], seconds: float) -> None:
        """A decode step whose sequence i drafted ks[i] tokens with methods[i] took `seconds`,
        drafting, forward, verifying and committing: a plain step times a one-token forward's
        worth of a step (`unit_seconds`), a drafting step what each drafting sequence added
        beyond the priced forwards (`overhead`)."""
        if seconds <= 0:
            return
        cost = self.step_cost(methods, ks)
        drafting = sum(1 for k in ks if k)
        if not drafting:
            unit = seconds / cost
            old = self.unit_seconds
            self.unit_seconds = unit if old is None else old + OVERHEAD_RATE * (unit - old)
            return
        if self.unit_seconds is None:
            return
        priced = cost - drafting * self.overhead  # the forwards alone
        sample = (seconds / self.unit_seconds - priced) / drafting
        overhead = self.overhead + OVERHEAD_RATE * (sample - self.overhead)
        self.overhead = min(max(overhead, SPEC_STEP_OVERHEAD), MAX_SPEC_STEP_OVERHEAD)

    def allocate(
        self, reach: list[list[float]], methods: list[str], rooms: list[int], start: list[int]
    ) -> list[int]:
        """Draft lengths from `start` up to `rooms` with the most committed tokens per cost.
        `reach[s][i]`: the probability that sequence s's draft token i + 1 is accepted (with
        every one before it), for i < rooms[s].

        Draft tokens go one at a time to the sequence whose next draft adds the most: along one
        path the most expected tokens (reach[s][k], falling with k), along another the most for
        what it adds to the step's cost (nothing for a token a drafter's forward at that depth
        makes anyway, or one that costs no forward, as a looked-up draft). The best allocation
        met on either path is the answer: the first is right where every draft token costs
        alike, the second where some cost nothing."""

        def by_reach(ks: list[int]) -> Callable[[int], float]:
            return lambda i: reach[i][ks[i]]

        def by_worth(ks: list[int]) -> Callable[[int], float]:
            # What one more draft token of sequence i adds to `step_cost`: the forward's next
            # token, the overhead of a first draft, a drafter forward past its deepest draft.
            total = len(ks) + sum(ks)
            forward = self.forward_cost(total + 1) - self.forward_cost(total)
            depths: dict[str, int] = {}
            for method, k in zip(methods, ks, strict=True):
                depths[method] = max(depths.get(method, 0), k)

            def worth(i: int) -> float:
                extra = forward + (self.overhead if ks[i] == 0 else 0.0)
                method = methods[i]
                if ks[i] >= depths[method]:  # a depth its drafter had not reached
                    extra += self.draft_costs.get(method, 0.0)
                    if depths[method] == 0:  # and its first: the drafter's launch too
                        extra += self.draft_launch_costs.get(method, 0.0)
                else:  # a further sequence at a depth already drafted
                    extra += self.row_cost(method)
                return reach[i][ks[i]] / max(extra, 1e-9)

            return worth

        first = sum(1 + sum(r[:k]) for r, k in zip(reach, start, strict=True))
        best, best_rate = list(start), first / self.step_cost(methods, start)
        # One sequence that may draft has one path.
        growable = sum(room > k for room, k in zip(rooms, start, strict=True))
        for order in (by_reach, by_worth) if growable > 1 else (by_reach,):
            ks, committed = list(start), first
            while growing := [i for i, room in enumerate(rooms) if ks[i] < room]:
                i = max(growing, key=order(ks))
                committed += reach[i][ks[i]]
                ks[i] += 1
                rate = committed / self.step_cost(methods, ks)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate = list(ks), rate
        return best
