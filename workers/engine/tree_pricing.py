"""When a draft tree pays instead of a chain, and how many of its nodes (the speculator's).

A sequence whose drafter drafts trees (EAGLE) may get one where the server allows them
(`SpecConfig.tree_nodes`) and its settings adjust no logits. Each step the speculator first
chooses its chain length k as for any draft (workers/engine/speculator.py); the chain's worth is
then E = 1 + c_1 + c_1 c_2 + ... (its acceptance curve), at the step's cost with k more tokens in
the forward and the chain's drafting. A tree of depth k is expected to commit `gain` times E
(the method's measured ratio of what its trees committed to what a chain was expected to, a
running mean from TREE_GAIN_PRIOR), at the cost of a step with the tree's nodes (as many as
its trees kept lately: `step_costs`, tree steps timed as served at start-up, where the
engine's runner pads the step's sequences to the tree's width and replays one wide graph; else
the chain curve by tokens) and of drafting it (`tree_costs`: a whole tree proposal, measured at
start-up in one-token target forwards). The tree is drafted where that is more tokens per cost.
Drafted, it is cut to its first n nodes (most likely first) where the step's expected tokens
per cost are highest, each node worth its reach (the drafter's probability that the target
accepts it and its ancestors). So where verifying grows with tokens (a CPU), trees stay small
or are not drafted; where a forward of 16 tokens costs what one does (a GPU), they grow.

The reach is the head's own estimate, and a head may be over- or under-confident: what a
method's cut trees accepted against the reach they were cut with (a running mean,
`calibration`, from 1) scales the reach a cut counts.

Other sequences in the step count as one token each (their drafts' worth is not counted, so a
tree is judged conservatively); a seeded sampled request is judged as if alone under the
priors alone, so that what it draws never depends on what the engine served before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.calibration import TreeStepCosts

# What a tree commits against the chain of its depth, before a method's trees are measured
# (EAGLE's trees of 16 nodes over chains of 4 on held-out prompts: 1.3-1.4x, docs/benchmarks.md).
TREE_GAIN_PRIOR = 1.3
GAIN_RATE = 0.1  # a running mean weighing about the last 10 tree steps
MAX_CALIBRATION = 4.0  # the most (and 1 / it the least) one step's reach is scaled by


@dataclass(slots=True)
class TreePricing:
    forward_cost: Callable[[int], float]  # a forward over n new tokens, in one-token forwards
    max_nodes: int  # the server's `tree_nodes`
    tree_costs: dict[str, float] = field(default_factory=dict)  # drafting a tree, per method
    gain: dict[str, float] = field(default_factory=dict)  # per method, measured
    nodes: dict[str, float] = field(default_factory=dict)  # nodes its trees kept, running mean
    calibration: dict[str, float] = field(default_factory=dict)  # accepted / reach, per method
    # Per sequence drafting a tree this step: its chain's worth, and the reach its cut kept.
    _steps: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Tree steps timed as served (calibration.py `tree_step_costs`); None: `forward_cost`.
    step_costs: TreeStepCosts | None = None

    def step_cost(self, others: int, nodes: int) -> float:
        """A step's forward with a tree of `nodes` beside `others` sequences' one token each."""
        if self.step_costs is None:
            return self.forward_cost(others + 1 + nodes)
        return self.step_costs.cost(others + 1, nodes + 1)

    def pays(
        self,
        method: str,
        chain_value: float,
        chain_cost: float,
        others: int,
        alone: bool,
    ) -> bool:
        """Whether a tree beats the chain worth `chain_value` tokens (1 + its reach) at
        `chain_cost` (forward and drafting), beside `others` other sequences' tokens."""
        gain = TREE_GAIN_PRIOR if alone else self.gain.get(method, TREE_GAIN_PRIOR)
        nodes = self.max_nodes / 2 if alone else self.nodes.get(method, self.max_nodes / 2)
        cost = self.step_cost(others, round(nodes)) + self.tree_costs.get(method, 0.0)
        return gain * chain_value / cost > chain_value / chain_cost

    def expect(self, request_id: str, chain_value: float) -> None:
        """The sequence drafts a tree this step where its chain was worth `chain_value`."""
        self._steps[request_id] = (chain_value, 0.0)

    def cut(
        self,
        reach: tuple[float, ...],
        others: int,
        others_value: float,
        method: str,
        request_id: str = "",
        alone: bool = False,
    ) -> int:
        """How many of a tree's nodes (of reach `reach`, most likely first) to verify beside
        `others` tokens worth `others_value`: the most tokens per forward cost, each node worth
        its reach as the method's trees have borne it out (`calibration`)."""
        scale = 1.0 if alone else self.calibration.get(method, 1.0)
        value, best = others_value + 1, 0
        best_rate = value / self.forward_cost(others + 1)
        for n, r in enumerate(reach, start=1):
            value += r * scale
            rate = value / self.step_cost(others, n)
            if rate > best_rate:
                best, best_rate = n, rate
        if request_id in self._steps:
            self._steps[request_id] = (self._steps[request_id][0], sum(reach[:best]))
        old = self.nodes.get(method)
        self.nodes[method] = best if old is None else old + GAIN_RATE * (best - old)
        return best

    def committed(self, request_id: str, method: str, tokens: int) -> None:
        """The sequence's step committed `tokens`: what its tree (if it drafted one this step)
        was worth against its chain, and against the reach it was cut with."""
        step = self._steps.pop(request_id, None)
        if step is None:
            return
        chain_value, reach = step
        old = self.gain.get(method, TREE_GAIN_PRIOR)
        self.gain[method] = old + GAIN_RATE * (tokens / chain_value - old)
        if reach > 0:
            sample = min(max((tokens - 1) / reach, 1 / MAX_CALIBRATION), MAX_CALIBRATION)
            old = self.calibration.get(method, 1.0)
            self.calibration[method] = old + GAIN_RATE * (sample - old)

    def forget(self, request_id: str) -> None:
        self._steps.pop(request_id, None)
