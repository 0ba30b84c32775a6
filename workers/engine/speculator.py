"""Which drafter drafts for whom, and how many tokens (adaptive k).

If the i-th draft token (i = 1, 2, ...) is accepted with probability c_i once every earlier one
was, a draft of k tokens yields E(k) = 1 + c_1 + c_1 c_2 + ... + c_1...c_k committed tokens per
verify step. A sequence's c_i are measured from its own steps: each is its acceptance rate at
position i among the steps that reached i, shrunk towards c_(i-1) (c_1 towards the sequence's
overall per-token rate, itself shrunk towards a prior: the acceptance its method had over the
finished requests' drafts, 1/2 before any). With one rate a everywhere that is the geometric
E(k) = (1 - a^(k+1)) / (1 - a). Measured per position it also sees copied text (an edited file,
a quote), often wrong at its first token but then right for long, which one rate would cut
short (workers/engine/sequence.py `acceptance_curve`). Where the server allows draft trees,
workers/engine/tree_pricing.py decides whose draft is a tree instead, and how large.

A step's cost, in one-token target forwards (its forward over every token and draft, its
drafters' work, the host overhead of each drafting sequence), is workers/engine/step_costs.py's.
The engine picks the k of every sequence (each in 0..its k_max) that maximizes the batch's
committed tokens per unit of cost, each sequence judged by its own c_i. For one sequence that is
the k maximizing E(k) / cost(k); in a batch, one sequence's drafts also make everyone's forward
longer, so k shrinks as the batch grows. From `disable_batch_size` unfinished requests on
(decoding, prefilling or waiting), nobody speculates at all. A request held at k = 0 still tries
one draft token now and then (rarely for a draft model, which must first catch up on everything
committed since its last draft); and while no finished request has drafted with its method, a
request drafts its full k at its first step, so that a method the prior of 1/2 rules out (a
draft model costing 0.4 target forwards a token, say) is measured once instead of never. A
seeded sampled request judges by its own drafts under the plain prior and explores only on its
own schedule, so its draws do not depend on what the engine served before it.

Drafts are only proposals: verification keeps the output exact whatever they hold. So a drafter
that raises (a bug, a consistency check) or proposes a token outside the vocabulary never fails
a request: the sequences it was serving in that call go on without speculation (their drafter
forgets them), the failure is logged and counted in `failures`, and everyone else is untouched.
A remote drafter (cluster/remote_drafting.py) already answers a failure with no drafts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import torch

from workers.drafting.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest
from workers.engine.config import RequestSpec, SpecConfig
from workers.engine.sequence import Sequence, acceptance_curve
from workers.engine.step_costs import StepCosts
from workers.engine.tree_pricing import TreePricing

# A request whose acceptance argues for k = 0 still drafts one token every this many steps, so a
# text that becomes predictable later (a quoted passage, say) is noticed.
EXPLORE_EVERY_STEPS = {"draft_model": 64}
DEFAULT_EXPLORE_EVERY_STEPS = 16
# The name a free draft (drafted without a forward: prompt lookup) is priced under: no cost.
LOOKED_UP = "lookup"

log = logging.getLogger(__name__)


class Speculator:
    def __init__(
        self,
        config: SpecConfig,
        drafters: dict[str, Drafter],
        max_model_len: int,
        verify_costs: tuple[float, ...] = (1.0,),
        draft_costs: dict[str, float] | None = None,
        vocab_size: int | None = None,
        draft_row_costs: dict[str, float] | None = None,
        draft_launch_costs: dict[str, float] | None = None,
        unit_seconds: float | None = None,
        tree_costs: dict[str, float] | None = None,
    ) -> None:
        self.config = config
        self.drafters = drafters
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # drafted ids must lie below it (None: not checked)
        # What a step costs, and the draft lengths that pay most for it (adaptive k).
        self.costs = StepCosts(
            verify_costs, draft_costs, draft_row_costs, draft_launch_costs, unit_seconds
        )
        if any(self.costs.draft_costs.values()):
            log.info(
                "a draft token costs (in one-token target forwards): %s", self.costs.describe()
            )
        self._planned: tuple[list[str], list[int]] | None = None  # this step's priced choice
        # Draft trees: when they pay and how large (workers/engine/tree_pricing.py).
        self.trees = TreePricing(self.costs.forward_cost, config.tree_nodes, dict(tree_costs or {}))
        self._curves: list[list[float]] = []  # this step's acceptance curves (adaptive k)
        # Per method, over finished requests that drafted: (accepted, rejected) drafts.
        self.pooled: dict[str, tuple[int, int]] = {}
        # Per method: calls into its drafter that raised or proposed an invalid draft.
        self.failures: dict[str, int] = {}

    def resolve(self, spec: RequestSpec | None) -> tuple[str, int]:
        """(method, k_max) for a request: its own settings over the server defaults."""
        spec = spec or RequestSpec()
        method = spec.method or self.config.method
        k = (
            self.config.num_speculative_tokens
            if spec.num_speculative_tokens is None
            else spec.num_speculative_tokens
        )
        if not spec.enabled or method == "none" or k == 0:
            return "none", 0
        if method not in self.drafters:
            raise ValueError(f"speculative method {method!r} is not available on this server")
        return method, k

    def max_draft_tokens(self, seq: Sequence, load: int) -> int:
        """The most tokens `seq` may draft this step (0: it does not speculate)."""
        if seq.spec_method == "none" or not self.speculates_at(load):
            return 0
        return max(
            0,
            min(
                seq.params.max_tokens - seq.num_output_tokens - 1,  # not past max_tokens
                self.max_model_len - len(seq.token_ids),  # nor past the context
                seq.max_spec_tokens,
            ),
        )

    def num_draft_tokens(self, seqs: list[Sequence], load: int) -> list[int]:
        """How many tokens each decoding sequence drafts this step."""
        rooms = [self.max_draft_tokens(seq, load) for seq in seqs]
        if not self.config.adaptive or not any(rooms):
            return rooms
        seeded = [seq.params.seed is not None and not seq.params.greedy for seq in seqs]
        acceptance = [
            acceptance_curve(seq.stats, 0.5 if alone else self.prior(seq.spec_method), room)
            for seq, alone, room in zip(seqs, seeded, rooms, strict=True)
        ]
        methods = [
            self._priced_as(seq) if room else "none" for seq, room in zip(seqs, rooms, strict=True)
        ]
        ks, limits = [0] * len(seqs), list(rooms)
        for i in range(len(seqs)):
            if seeded[i] and rooms[i]:
                # A seeded sampled request drafts as if it were alone, so that what it draws
                # does not depend on what else is in the batch.
                solo = self.costs.allocate([acceptance[i]], [methods[i]], [rooms[i]], [0])
                ks[i] = limits[i] = solo[0]
        ks = self.costs.allocate(acceptance, methods, limits, ks)
        self._curves = acceptance
        for i, seq in enumerate(seqs):
            if not rooms[i] or ks[i]:
                continue
            explore = EXPLORE_EVERY_STEPS.get(seq.spec_method, DEFAULT_EXPLORE_EVERY_STEPS)
            untried = seq.spec_method not in self.pooled and not seeded[i]
            if untried and seq.stats.verify_steps == 0:
                ks[i] = rooms[i]  # nobody has measured this method yet: measure it
            elif seq.stats.verify_steps % explore == explore - 1:
                ks[i] = 1
        self._planned = (methods, ks)
        return ks

    @property
    def times_this_step(self) -> bool:
        """Whether this step's draft lengths were chosen here, so its time tells their cost
        (`observe_step`); not where nobody speculates (`disable_batch_size`) or k is fixed."""
        return self._planned is not None

    def observe_step(self, num_seqs: int, seconds: float) -> None:
        """A decode step of `num_seqs` sequences took `seconds`; where they are those this
        step's draft lengths were chosen for, it prices what drafting adds (`StepCosts.observe`)."""
        planned, self._planned = self._planned, None
        if planned is not None and len(planned[1]) == num_seqs:
            self.costs.observe(*planned, seconds)

    def _priced_as(self, seq: Sequence) -> str:
        """The method whose cost `seq`'s draft is charged at: its own, or none (a draft its
        drafter makes without a forward, as EAGLE's prompt lookup does, is free)."""
        try:
            free = self.drafters[seq.spec_method].drafts_for_free(seq.request_id)
        except Exception:  # a question about the price must not fail the step
            free = False
        return LOOKED_UP if free else seq.spec_method

    def prior(self, method: str) -> float:
        """The acceptance rate `method` had over finished requests' drafts (1/2 before any)."""
        accepted, rejected = self.pooled.get(method, (0, 0))
        return (accepted + 1) / (accepted + rejected + 2)

    def add(self, seq: Sequence) -> None:
        if seq.spec_method != "none":
            try:
                drafter = self.drafters[seq.spec_method]
                drafter.add(seq.request_id, seq.prompt_token_ids, seq.params)
                if seq.output_token_ids:  # continued from another engine with its output
                    drafter.commit(seq.request_id, seq.output_token_ids)
            except Exception as exc:
                self._drop(seq.spec_method, [seq], "add", exc)

    def speculates_at(self, load: int) -> bool:
        """Whether anyone drafts while `load` requests are unfinished (`disable_batch_size`)."""
        return load < self.config.disable_batch_size

    def hidden_layers(self, seqs: Iterable[Sequence], load: int) -> tuple[int, ...]:
        """Target layers whose hidden states the drafters of these sequences read; none while
        the load keeps everyone from speculating (`disable_batch_size`): handing each
        sequence its rows every step costs the host more than a GPU step of a small model,
        and a drafter that misses some starts its context over after the gap."""
        if not self.speculates_at(load):
            return ()
        layers: set[int] = set()
        for seq in seqs:
            if seq.spec_method != "none":
                layers.update(self.drafters[seq.spec_method].hidden_layers)
        return tuple(sorted(layers))

    def observe_hidden(
        self, seq: Sequence, first_position: int, hidden: dict[int, torch.Tensor]
    ) -> int:
        """Hand the drafter of `seq` the rows of its layers (`hidden`: layer -> rows); returns
        the bytes handed over (0 when its drafter reads no features)."""
        if seq.spec_method == "none":
            return 0
        drafter = self.drafters[seq.spec_method]
        if not drafter.hidden_layers:
            return 0
        rows = torch.cat([hidden[layer] for layer in drafter.hidden_layers], dim=-1)
        try:
            drafter.observe_hidden(seq.request_id, first_position, rows)
        except Exception as exc:
            self._drop(seq.spec_method, [seq], "observe_hidden", exc)
            return 0
        return rows.numel() * rows.element_size()

    def commit(self, seq: Sequence, token_ids: list[int]) -> None:
        if self.config.tree_nodes:  # what a tree drafted this step was worth
            self.trees.committed(seq.request_id, seq.spec_method, len(token_ids))
        if seq.spec_method != "none":
            try:
                self.drafters[seq.spec_method].commit(seq.request_id, token_ids)
            except Exception as exc:
                self._drop(seq.spec_method, [seq], "commit", exc)

    def remove(self, seq: Sequence) -> None:
        """A finished (or aborted) sequence: its drafter forgets it, and its drafts join its
        method's pooled acceptance."""
        self.trees.forget(seq.request_id)
        if seq.spec_method == "none":
            return
        try:
            self.drafters[seq.spec_method].remove(seq.request_id)
        except Exception as exc:
            self._drop(seq.spec_method, [seq], "remove", exc)
            return
        stats = seq.stats
        if stats.drafted:
            accepted, rejected = self.pooled.get(seq.spec_method, (0, 0))
            self.pooled[seq.spec_method] = (
                accepted + stats.accepted,
                rejected + stats.verify_steps_with_rejection,
            )

    def propose(self, decoding: Iterable[Sequence], batch_size: int | None = None) -> None:
        """Set `seq.draft` for every decoding sequence (empty where it should not speculate).
        `batch_size` is the load speculation is judged by (default: the decoding sequences);
        the engine counts every unfinished request, so a burst of arrivals turns speculation
        off before they all decode rather than after."""
        seqs = list(decoding)
        load = len(seqs) if batch_size is None else batch_size
        self._planned = None  # set again where this step's lengths are chosen
        by_method: dict[str, list[tuple[Sequence, DraftRequest]]] = {}
        # Nobody drafts past `disable_batch_size`: no per-sequence choice to make.
        self._curves = []
        ks = self.num_draft_tokens(seqs, load) if self.speculates_at(load) else [0] * len(seqs)
        step_tokens = len(seqs) + sum(ks)
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            seq.draft = EMPTY_DRAFT
            if seq.spec_method == "none":
                continue
            # Every drafter in use is called, with no requests if need be: a remote drafter
            # sends its buffered commits and features with the call, so they never pile up.
            pairs = by_method.setdefault(seq.spec_method, [])
            if k > 0:
                tree = self._tree_nodes(seq, i, k, step_tokens - 1 - k)
                pairs.append((seq, DraftRequest(seq.request_id, len(seq.token_ids), k, tree)))
        for method, pairs in by_method.items():
            try:
                drafts = self.drafters[method].propose([req for _, req in pairs])
            except Exception as exc:
                self._drop(method, [seq for seq, _ in pairs], "propose", exc)
                continue
            for seq, req in pairs:
                draft = drafts.get(seq.request_id, EMPTY_DRAFT)
                # k bounds a chain's tokens; a tree's depth (its nodes: `tree_nodes`, and the
                # context left, as each node takes a cache row).
                room = min(req.tree_nodes, self.max_model_len - len(seq.token_ids))
                draft = draft.truncated(room if draft.parents else req.k)
                if self._valid(draft):
                    seq.draft = draft
                else:
                    error = ValueError(f"a draft outside the vocabulary: {draft.token_ids}")
                    self._drop(method, [seq], "propose", error)
        if self.config.tree_nodes:
            self._trim_trees(seqs)

    def _tree_nodes(self, seq: Sequence, index: int, k: int, others: int) -> int:
        """The largest tree `seq` may get this step (0: a chain of k): trees are on, its
        drafter drafts them, it adjusts no logits, and (adaptive k) a tree pays (tree_pricing)."""
        method = seq.spec_method
        allowed = self.config.tree_nodes and self.drafters[method].drafts_trees
        if not allowed or seq.adjusts_logits:
            return 0
        if self._curves:
            if self._priced_as(seq) == LOOKED_UP:  # a looked-up chain costs nothing
                return 0
            alone = seq.params.seed is not None and not seq.params.greedy
            value = 1 + sum(self._curves[index][:k])
            others = 0 if alone else others
            drafting = k * self.costs.draft_costs.get(method, 0.0)
            cost = self.costs.forward_cost(others + 1 + k) + drafting
            if not self.trees.pays(method, value, cost, others, alone):
                return 0
            self.trees.expect(seq.request_id, value)
        return self.config.tree_nodes

    def _trim_trees(self, seqs: list[Sequence]) -> None:
        """Cut each tree to the nodes that pay (adaptive k); `observe_step` times chains only."""
        trees = [seq for seq in seqs if seq.draft.parents is not None]
        if not trees:
            return
        self._planned = None
        if not self._curves:
            return
        tokens = sum(1 + len(seq.draft.token_ids) for seq in seqs)
        for seq in trees:
            reach = seq.draft.reach or ()
            own = 1 + len(seq.draft.token_ids)
            alone = seq.params.seed is not None and not seq.params.greedy
            others = 0 if alone else tokens - own
            others_value = 0 if alone else len(seqs) - 1
            best = self.trees.cut(
                reach, others, others_value, seq.spec_method, seq.request_id, alone
            )
            seq.draft = seq.draft.truncated(best) if best else EMPTY_DRAFT
            tokens = others + 1 + best

    def _valid(self, draft: Draft) -> bool:
        """Whether the forward can take the draft: ids in the vocabulary, q as wide as it."""
        if self.vocab_size is None or not draft.token_ids:
            return True
        if not (min(draft.token_ids) >= 0 and max(draft.token_ids) < self.vocab_size):
            return False
        return draft.probs is None or draft.probs.shape[-1] == self.vocab_size

    def _drop(self, method: str, seqs: list[Sequence], what: str, exc: Exception) -> None:
        """`method`'s drafter failed in `what` for these sequences: count it, log it, and let
        them decode without speculation from now on (their drafter forgets them, as far as it
        still can)."""
        self.failures[method] = self.failures.get(method, 0) + 1
        log.error(
            "the %s drafter failed in %s; %s go on without speculation",
            method,
            what,
            ", ".join(seq.request_id for seq in seqs) or "no requests",
            exc_info=exc,
        )
        for seq in seqs:
            seq.spec_method = "none"
            seq.draft = EMPTY_DRAFT
            if what != "remove":
                with contextlib.suppress(Exception):
                    self.drafters[method].remove(seq.request_id)
