"""Which drafter drafts for whom, and how many tokens (adaptive k).

With per-token acceptance rate a, a draft of k tokens yields E(k) = (1 - a^(k+1)) / (1 - a)
committed tokens per verify step. The step costs verify(k) one-token forwards (a forward over
k + 1 tokens, measured at start-up: workers/engine/calibration.py) plus k draft tokens at the
drafter's cost (zero for n-gram drafters, measured for a draft model). Each request gets the k
in 0..k_max that maximizes E(k) / cost(k) for its own measured a (a prior of 1/2 until it has
history). Verification is only nearly free while the batch is small: from `disable_batch_size`
unfinished requests on (decoding, prefilling or waiting), nobody speculates, so speculation never
makes a large load slower. A
request held at k = 0 still tries one draft token now and then (rarely for a draft model,
which must first catch up on everything committed since its last draft).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from workers.drafting.base import EMPTY_DRAFT, Drafter, DraftRequest
from workers.engine.config import RequestSpec, SpecConfig
from workers.engine.sequence import Sequence

# Drafting, rejection sampling and rollback are host work that a verify step does on top of its
# forward: a few percent of a one-token forward for the bundled model on a CPU. Charged to every
# step with k >= 1, it keeps marginal speculation (a gain of a few percent on paper) off.
SPEC_STEP_OVERHEAD = 0.05
# A request whose acceptance argues for k = 0 still drafts one token every this many steps, so a
# text that becomes predictable later (a quoted passage, say) is noticed.
EXPLORE_EVERY_STEPS = {"draft_model": 64}
DEFAULT_EXPLORE_EVERY_STEPS = 16
# Beta prior on the acceptance rate: as if 1 accepted and 1 rejected draft were already seen.
_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.0, 1.0


def expected_tokens(acceptance: float, k: int) -> float:
    """Committed tokens per verify step with k drafts each accepted with prob `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def best_num_draft_tokens(acceptance: float, step_costs: list[float]) -> int:
    """The k with the most committed tokens per unit of cost; `step_costs[k]` is the cost of a
    verify step with k drafts (drafting included)."""
    return max(range(len(step_costs)), key=lambda k: expected_tokens(acceptance, k) / step_costs[k])


class Speculator:
    def __init__(
        self,
        config: SpecConfig,
        drafters: dict[str, Drafter],
        max_model_len: int,
        verify_costs: tuple[float, ...] = (1.0,),
        draft_costs: dict[str, float] | None = None,
    ) -> None:
        self.config = config
        self.drafters = drafters
        self.max_model_len = max_model_len
        self.verify_costs = verify_costs
        # A drafted token's cost in one-token target forwards, per method (0 when not listed).
        self.draft_costs = dict(draft_costs or {})

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

    def step_costs(self, method: str, k_max: int) -> list[float]:
        """Cost of a verify step with 0..k_max drafts from `method`, in one-token forwards."""
        per_draft = self.draft_costs.get(method, 0.0)
        last = len(self.verify_costs) - 1
        return [1.0] + [
            self.verify_costs[min(k, last)] + k * per_draft + SPEC_STEP_OVERHEAD
            for k in range(1, k_max + 1)
        ]

    def num_draft_tokens(self, seq: Sequence, batch_size: int) -> int:
        """How many tokens to draft for `seq` this step."""
        if seq.spec_method == "none" or batch_size >= self.config.disable_batch_size:
            return 0
        room = min(
            seq.params.max_tokens - len(seq.output_token_ids) - 1,  # never draft past max_tokens
            self.max_model_len - len(seq.token_ids),  # nor past the context
            seq.max_spec_tokens,
        )
        if room <= 0:
            return 0
        if not self.config.adaptive:
            return room
        stats = seq.stats
        rejected = stats.verify_steps_with_rejection
        acceptance = (stats.accepted + _PRIOR_ACCEPTED) / (
            stats.accepted + rejected + _PRIOR_ACCEPTED + _PRIOR_REJECTED
        )
        k = best_num_draft_tokens(acceptance, self.step_costs(seq.spec_method, room))
        explore = EXPLORE_EVERY_STEPS.get(seq.spec_method, DEFAULT_EXPLORE_EVERY_STEPS)
        if k == 0 and stats.verify_steps % explore == explore - 1:
            return 1
        return k

    def add(self, seq: Sequence) -> None:
        if seq.spec_method != "none":
            self.drafters[seq.spec_method].add(seq.request_id, seq.prompt_token_ids, seq.params)

    def hidden_layers(self, seqs: Iterable[Sequence]) -> tuple[int, ...]:
        """Target layers whose hidden states the drafters of these sequences read."""
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
        drafter.observe_hidden(seq.request_id, first_position, rows)
        return rows.numel() * rows.element_size()

    def commit(self, seq: Sequence, token_ids: list[int]) -> None:
        if seq.spec_method != "none":
            self.drafters[seq.spec_method].commit(seq.request_id, token_ids)

    def remove(self, seq: Sequence) -> None:
        if seq.spec_method != "none":
            self.drafters[seq.spec_method].remove(seq.request_id)

    def propose(self, decoding: Iterable[Sequence], batch_size: int | None = None) -> None:
        """Set `seq.draft` for every decoding sequence (empty where it should not speculate).
        `batch_size` is the load speculation is judged by (default: the decoding sequences);
        the engine counts every unfinished request, so a burst of arrivals turns speculation
        off before they all decode rather than after."""
        seqs = list(decoding)
        load = len(seqs) if batch_size is None else batch_size
        by_method: dict[str, list[tuple[Sequence, DraftRequest]]] = {}
        for seq in seqs:
            seq.draft = EMPTY_DRAFT
            if seq.spec_method == "none":
                continue
            # Every drafter in use is called, with no requests if need be: a remote drafter
            # sends its buffered commits and features with the call, so they never pile up.
            pairs = by_method.setdefault(seq.spec_method, [])
            k = self.num_draft_tokens(seq, load)
            if k > 0:
                pairs.append((seq, DraftRequest(seq.request_id, len(seq.token_ids), k)))
        for method, pairs in by_method.items():
            drafts = self.drafters[method].propose([req for _, req in pairs])
            for seq, req in pairs:
                seq.draft = drafts.get(seq.request_id, EMPTY_DRAFT).truncated(req.k)
