"""EAGLE's draft trees on a tiny random target: every node is among its parent's most likely
children as the unrolled training forward over its path has them, with the reach of its path;
and a drafter actor answers a tree request with one."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.drafter_worker import DrafterWorker, DraftStep
from tests.factories import tiny_eagle_head, tiny_model
from workers.drafting.base import Draft, DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import LoopConfig
from workers.drafting.eagle_tree import BRANCH
from workers.eagle.unroll import unrolled_outputs
from workers.engine.sampling_params import SamplingParams
from workers.model.transformer import TransformerLM

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target() -> TransformerLM:
    return tiny_model(seed=3)


def paths(draft: Draft) -> list[list[int]]:
    """Each node's tokens from the first depth down to itself."""
    assert draft.parents is not None
    out: list[list[int]] = []
    for token, parent in zip(draft.token_ids, draft.parents, strict=True):
        out.append([*(out[parent] if parent >= 0 else []), token])
    return out


@pytest.mark.parametrize(("context", "nodes"), [(3, 12), (9, 24)])
def test_tree_nodes_are_their_parents_likeliest_children(target, context: int, nodes: int) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    drafter = EagleDrafter(head, target, num_blocks=64, block_size=4)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 97, (context + 1,), generator=gen).tolist()
    width = len(head.config.target_layers) * target.config.hidden_size
    features = torch.randn(context, width, generator=gen)
    drafter.add("a", tokens, GREEDY)
    drafter.observe_hidden("a", 0, features)
    k = 4
    tree = drafter.propose([DraftRequest("a", context + 1, k, nodes)])["a"]
    chain = EagleDrafter(head, target, num_blocks=64, block_size=4)
    chain.add("a", tokens, GREEDY)
    chain.observe_hidden("a", 0, features)
    assert tree.parents is not None and tree.reach is not None
    assert len(tree.token_ids) == nodes and tree.depth <= k
    assert list(tree.reach) == sorted(tree.reach, reverse=True)
    first = chain.propose([DraftRequest("a", context + 1, k)])["a"].token_ids
    assert tree.token_ids[0] == first[0]  # the likeliest node is the chain's first token
    for path, reach in zip(paths(tree), tree.reach, strict=True):
        # Training's view of the path: its tokens as if they were the continuation.
        seq = tokens + path
        padded = torch.zeros(1, len(seq) - 1, width)
        padded[0, :context] = features
        next_tokens = torch.tensor(seq[1:]).unsqueeze(0)
        with torch.no_grad():
            outputs = unrolled_outputs(head, next_tokens, padded, len(path))
        log_reach = 0.0
        for j, token in enumerate(path):
            with torch.no_grad():
                logits = head.draft_logits(outputs[j][0, context - 1 + j]).float()
            top = head.draft_vocab[logits.topk(BRANCH).indices].tolist()
            assert token in top, (path, j)
            index = int((head.draft_vocab == token).nonzero())
            log_reach += float(torch.log_softmax(logits, -1)[index])
        assert reach == pytest.approx(math.exp(log_reach), rel=1e-3, abs=1e-6)


def test_a_drafter_actor_answers_with_a_tree(target) -> None:  # type: ignore[no-untyped-def]
    head = tiny_eagle_head(target)
    worker = DrafterWorker(
        lambda: EagleDrafter(head, target, num_blocks=32, block_size=4), "d", draft_ahead=True
    )
    assert worker.info()["drafts_trees"] is True
    width = len(head.config.target_layers) * target.config.hidden_size
    drafter = worker.drafter
    assert isinstance(drafter, EagleDrafter)
    worker.step(DraftStep(worker.incarnation, [("add", "a", [5, 17, 33, 8], GREEDY)], []))
    drafter.observe_hidden("a", 0, torch.randn(3, width))
    reply = worker.step(DraftStep(worker.incarnation, [], [DraftRequest("a", 4, 3, 8)]))
    tokens, probs, parents, reach = reply.drafts["a"]
    assert len(tokens) == 8 and probs is None and parents is not None and reach is not None
    assert Draft(tokens, probs, parents, reach).depth <= 3


@pytest.mark.parametrize("depth", [2, 4])
def test_the_tree_loop_drafts_the_eager_drafters_trees(target, depth: int) -> None:  # type: ignore[no-untyped-def]
    """The fixed-shape tree program (a graph on a GPU, run eagerly here) against the eager tree
    drafter, for three sequences at once, twice (the second after commits, its fed rows rolled
    back)."""
    head = tiny_eagle_head(target)
    loop = LoopConfig(max_seqs=4, max_depth=4, tree_nodes=12)
    eager = EagleDrafter(head, target, num_blocks=64, block_size=4)
    looped = EagleDrafter(head, target, num_blocks=64, block_size=4, loop=loop)
    assert looped.tree_loop is not None
    gen = torch.Generator().manual_seed(6)
    width = len(head.config.target_layers) * target.config.hidden_size
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (4, 9, 6)]
    features = [torch.randn(len(p) + 2, width, generator=gen) for p in prompts]
    for drafter in (eager, looped):
        for i, p in enumerate(prompts):
            drafter.add(f"r{i}", p, GREEDY)
            drafter.observe_hidden(f"r{i}", 0, features[i][: len(p) - 1])
    asks = [DraftRequest(f"r{i}", len(p), depth, 12) for i, p in enumerate(prompts)]
    for round_ in range(2):
        want, got = eager.propose(asks), looped.propose(asks)
        for rid in want:
            assert got[rid].token_ids == want[rid].token_ids, (round_, rid)
            assert got[rid].parents == want[rid].parents
            assert got[rid].reach == pytest.approx(want[rid].reach, rel=1e-4)
        # The first node and its bonus token accepted: their features and tokens come.
        for drafter in (eager, looped):
            for i, p in enumerate(prompts):
                drafter.observe_hidden(f"r{i}", len(p) - 1, features[i][len(p) - 1 : len(p) + 1])
                drafter.commit(f"r{i}", [want[f"r{i}"].token_ids[0], 7])
        asks = [DraftRequest(f"r{i}", len(p) + 2, depth, 12) for i, p in enumerate(prompts)]
    assert looped.tree_loop.num_eager_runs == 2
