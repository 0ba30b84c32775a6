"""When the speculator asks for a draft tree and how much of it it keeps (tree_pricing.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest

from tests.factories import tiny_eagle_head, tiny_model
from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.engine.calibration import TreeStepCosts
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.engine.speculator import Speculator
from workers.engine.tree_pricing import TREE_GAIN_PRIOR, TreePricing
from workers.kv_cache import BlockAllocator, BlockTable

REACH = (0.9, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02)


def flat(n: int) -> float:
    return 1.0


def steep(n: int) -> float:
    return 1.0 + 0.25 * (n - 1)


def test_cut_keeps_what_pays_at_the_verify_costs() -> None:
    assert TreePricing(flat, 8).cut(REACH, 0, 0.0, "eagle") == 8  # every node adds, none costs
    # At 0.25 a token, a node pays while the rate (1 + reach so far) / cost still grows.
    assert TreePricing(steep, 8).cut(REACH, 0, 0.0, "eagle") == 3
    assert TreePricing(steep, 8).cut((0.1, 0.05), 0, 0.0, "eagle") == 0  # not worth a token


def test_a_head_whose_trees_accept_less_than_their_reach_gets_smaller_trees() -> None:
    """Trees that commit 1 draft token a step whatever their reach: the first cut keeps three
    nodes (reach 2.0), the method's calibration falls, cuts keep two (reach 1.5), and the
    calibration settles at what those bear out (1 / 1.5); a seeded sampled request's cut stays
    at the prior's."""
    pricing = TreePricing(steep, 8)
    for step in range(40):
        pricing.expect(f"r{step}", 2.0)
        kept = pricing.cut(REACH, 0, 0.0, "eagle", f"r{step}")
        pricing.committed(f"r{step}", "eagle", 2)  # one draft token and the bonus
        if step == 0:
            assert kept == 3 and sum(REACH[:kept]) == pytest.approx(2.0)
    assert pricing.calibration["eagle"] == pytest.approx(1 / 1.5, abs=0.02)
    assert pricing.cut(REACH, 0, 0.0, "eagle") == 2
    assert pricing.cut(REACH, 0, 0.0, "eagle", alone=True) == 3
    pricing.committed("unknown", "eagle", 5)  # no tree this step: nothing moves
    assert pricing.calibration["eagle"] == pytest.approx(1 / 1.5, abs=0.02)


def test_a_tree_pays_where_its_nodes_cost_little_and_gain_is_measured() -> None:
    pricing = TreePricing(flat, 16, tree_costs={"eagle": 0.3})
    # Chain worth 2 tokens at cost 1.2 (1.67/unit); a tree 1.3 x 2 at 1 + 0.3 (2.0/unit).
    assert pricing.pays("eagle", 2.0, 1.2, 0, alone=False)
    for _ in range(50):  # its trees commit no more than the chain would have
        pricing.expect("r", 2.0)
        pricing.committed("r", "eagle", 2)
    assert pricing.gain["eagle"] == pytest.approx(1.0, abs=0.01)
    assert not pricing.pays("eagle", 2.0, 1.2, 0, alone=False)
    # A seeded sampled request judges by the prior alone, whatever others' trees did.
    assert pricing.pays("eagle", 2.0, 1.2, 0, alone=True)
    assert not TreePricing(steep, 16, {"eagle": 0.3}).pays("eagle", 2.0, 1.2, 0, alone=False)
    pricing.cut(REACH[:4], 0, 0.0, "eagle")
    assert pricing.nodes["eagle"] == 4


class TreeDrafter(Drafter):
    """Answers a tree request with a fixed tree, a chain request with a chain."""

    method = "eagle"
    drafts_trees = True

    def __init__(self) -> None:
        self.requests: list[DraftRequest] = []

    def add(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        pass

    def commit(self, request_id: str, token_ids: Seq[int]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        pass

    def propose(self, requests: Seq[DraftRequest]) -> dict[str, Draft]:
        self.requests += requests
        parents = (-1, -1, 0, 0, 2, 1, 4, 3)
        return {
            r.request_id: Draft(list(range(8)), parents=parents, reach=REACH)
            if r.tree_nodes
            else Draft([1] * r.k)
            for r in requests
        }


def sequence(rid: str, params: SamplingParams) -> Sequence:
    return Sequence(
        rid, [1, 2, 3], params, "eagle", 4, BlockTable(BlockAllocator(4), 16), None, 0,
        token_ids=[1, 2, 3],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("costs", "adaptive", "nodes"),
    [
        ((1.0,) * 16, True, 8),  # flat: the tree is asked for and kept whole
        (tuple(steep(n) for n in range(1, 17)), True, 0),  # steep: a chain pays more
        (tuple(steep(n) for n in range(1, 17)), False, 8),  # fixed k: trees as configured
    ],
)
def test_the_speculator_asks_for_trees_where_they_pay(
    costs: tuple[float, ...], adaptive: bool, nodes: int
) -> None:
    """`nodes`: the tree's size, or 0 where the sequence drafts a chain."""
    drafter = TreeDrafter()
    spec = SpecConfig(method="eagle", adaptive=adaptive, tree_nodes=8, disable_batch_size=64)
    speculator = Speculator(spec, {"eagle": drafter}, 512, costs)
    seq = sequence("r", SamplingParams(max_tokens=100, temperature=0))
    speculator.propose([seq])
    assert (seq.draft.parents is not None) == (nodes > 0)
    assert drafter.requests[-1].tree_nodes == (8 if nodes else 0)
    if nodes:
        assert (
            len(seq.draft.token_ids) == nodes
        )  # what it committed against the chain's worth moves the method's gain
        speculator.commit(seq, [1, 2, 3, 4])
        assert (speculator.trees.gain.get("eagle", TREE_GAIN_PRIOR) != TREE_GAIN_PRIOR) == adaptive


def test_requests_that_adjust_logits_get_chains() -> None:
    drafter = TreeDrafter()
    spec = SpecConfig(method="eagle", tree_nodes=8, verify_costs=(1.0,) * 16)
    speculator = Speculator(spec, {"eagle": drafter}, 512, (1.0,) * 16)
    penalized = sequence("p", SamplingParams(max_tokens=100, presence_penalty=0.5))
    speculator.propose([penalized])
    assert drafter.requests[-1].tree_nodes == 0 and penalized.draft.parents is None


def test_a_tree_near_the_end_of_the_context_keeps_a_row_for_each_node() -> None:
    """Each node takes a cache row: three tokens from the context's end, a tree keeps three."""
    drafter = TreeDrafter()
    spec = SpecConfig(method="eagle", adaptive=False, tree_nodes=8, disable_batch_size=64)
    speculator = Speculator(spec, {"eagle": drafter}, 6, (1.0,) * 16)
    seq = sequence("r", SamplingParams(max_tokens=100, temperature=0))  # 3 tokens of 6
    speculator.propose([seq])
    assert seq.draft.parents is not None and len(seq.draft.token_ids) == 3


def test_tree_steps_are_priced_by_their_timed_widths() -> None:
    """With tree steps timed as served (each step padded to a captured tree width), a cut
    pays for the width its nodes round up to, not for its tokens: a step of 9 wide costs what
    9 nodes do, so nodes up to that width come free and the ninth node's width costs 4x."""
    costs = TreeStepCosts(
        256, (1, 2), (9, 17), {(1, 9): 1.2, (1, 17): 4.8, (2, 9): 2.0, (2, 17): 6.0}
    )
    assert costs.cost(1, 5) == 1.2 and costs.cost(2, 9) == 2.0 and costs.cost(1, 10) == 4.8
    assert costs.cost(4, 34) == 6.0 * 2 * 2  # past the timed shapes: in proportion
    pricing = TreePricing(steep, 16, step_costs=costs)
    assert pricing.step_cost(0, 8) == 1.2
    assert pricing.cut((0.9,) * 16, 0, 0.0, "eagle") == 8  # the 9-wide graph's nodes, no more
    assert TreePricing(steep, 16).cut((0.9,) * 16, 0, 0.0, "eagle") == 16  # by tokens: all


@pytest.mark.parametrize("runner", ["eager", "graphs"])
def test_an_engine_that_drafts_trees_times_its_tree_steps(runner: str) -> None:
    """At start-up, over a quarter of the served context: each tree width the runner serves,
    at each step size trees are drafted at (the padded graph path's widths where it has them)."""
    model = tiny_model(seed=3, max_position_embeddings=1024)
    spec = SpecConfig(num_speculative_tokens=4, tree_nodes=20, disable_batch_size=4)
    config = EngineConfig(max_model_len=512, block_size=8, max_num_seqs=8, spec=spec)
    graphs = None
    if runner == "graphs":
        from kernels.attention_uniform import UniformTorchAttention
        from workers.engine.graph_runner import graph_runner

        graphs = graph_runner(model, config)
        graphs.attention = UniformTorchAttention()
    drafter = EagleDrafter(tiny_eagle_head(model), model, num_blocks=64, block_size=8)
    engine = LLMEngine(model, config, runner=graphs, drafters={"eagle": drafter})
    costs = engine.speculator.trees.step_costs
    assert costs is not None and costs.context == 128
    assert costs.widths == (9, 17, 21) and costs.sizes == (1, 2, 4)
    assert all(c > 0 for c in costs.costs.values())
    assert engine.allocator.num_free_blocks == config.kv_blocks  # the blocks lent came back
