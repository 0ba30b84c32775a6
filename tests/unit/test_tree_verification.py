"""Verifying draft trees: the greedy walk, multi-candidate rejection sampling's distribution
(chi-square), and the accepted nodes' K/V moved to a chain's rows."""

from __future__ import annotations

import pytest
import torch

from tests.factories import tiny_config
from tests.unit.test_rejection import CHI2_CRITICAL_0_001, chi_square
from workers.drafting.base import Draft
from workers.engine.tree_verification import accept_greedy, accept_sampled, children_of, settle
from workers.kv_cache import PagedKVCache

# Root children: tokens 3 (node 0) and 1 (node 1); node 0's children 2 (node 2) and 5 (node 3);
# node 2's child 4 (node 4).
TOKENS = [3, 1, 2, 5, 4]
PARENTS = (-1, -1, 0, 0, 2)


def test_children_in_draft_order() -> None:
    assert children_of(PARENTS) == [[1, 2], [3, 4], [], [5], [], []]


@pytest.mark.parametrize(
    ("best", "tokens", "path"),
    [
        ([3, 2, 0, 4, 0, 7], [3, 2, 4, 7], [0, 1, 3, 5]),  # the deepest path, then the bonus
        ([3, 5, 0, 0, 6, 0], [3, 5, 6], [0, 1, 4]),  # the second child at depth 2, a leaf
        ([1, 0, 9, 0, 0, 0], [1, 9], [0, 2]),  # the root's second child
        ([0, 2, 0, 0, 0, 0], [0], [0]),  # no child agrees: the target's own token
        ([3, 1, 0, 0, 0, 0], [3, 1], [0, 1]),  # node 0 has no child holding 1
    ],
)
def test_greedy_walk(best: list[int], tokens: list[int], path: list[int]) -> None:
    assert accept_greedy(TOKENS, PARENTS, best) == (tokens, path)


def test_multi_candidate_rejection_keeps_the_target_distribution() -> None:
    """Two tokens drawn through the tree: the first as the root's row says, the second as the
    row of the first token's node says (or the root's where it was no candidate, and the step
    ends: then nothing follows). Chi-square over the joint of (first, second)."""
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1 + len(TOKENS), vocab, generator=gen) * 1.5, dim=-1)
    trials = 20_000
    counts = torch.zeros(vocab, vocab + 1)  # [first, second or "none" in the last column]
    draws = torch.Generator().manual_seed(1)
    for _ in range(trials):
        tokens, path = accept_sampled(TOKENS, PARENTS, probs, draws)
        assert len(tokens) == len(path)
        counts[tokens[0], tokens[1] if len(tokens) > 1 else vocab] += 1
    expected = torch.zeros(vocab, vocab + 1)
    root_children = {TOKENS[c - 1]: c for c in children_of(PARENTS)[0]}
    for first in range(vocab):
        if first in root_children:
            expected[first, :vocab] = probs[0, first] * probs[root_children[first]]
        else:
            expected[first, vocab] = probs[0, first]
    keep = expected.flatten() > 0
    dof = int(keep.sum()) - 1
    critical = CHI2_CRITICAL_0_001.get(dof, dof + 3.3 * (2 * dof) ** 0.5)  # ~0.001 tail
    assert chi_square(counts.flatten()[keep], expected.flatten()[keep]) < critical


def test_a_certain_target_follows_its_candidate() -> None:
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 2, 0, 4, 0, 4]), 6).float()
    tokens, path = accept_sampled(TOKENS, PARENTS, one_hot, torch.Generator().manual_seed(0))
    assert (tokens, path) == ([3, 2, 4, 4], [0, 1, 3, 5])


def test_settle_moves_the_path_to_a_chain_rows() -> None:
    cache = PagedKVCache(tiny_config(), num_blocks=6, block_size=4, dtype=torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape))
    block_ids = [5, 2, 0]
    layers, _, _, _, heads, dim = cache.data.shape
    flat = cache.data.view(layers, 2, 24, heads, dim)

    def slot(p: int) -> int:
        return block_ids[p // 4] * 4 + p % 4

    before = flat.clone()
    settle(cache, block_ids, 3, [0, 1, 3, 5])  # the root at row 3, then tree rows 4, 6, 8
    for j, r in enumerate([0, 1, 3, 5]):
        assert torch.equal(flat[:, :, slot(3 + j)], before[:, :, slot(3 + r)])
    assert torch.equal(flat[:, :, slot(2)], before[:, :, slot(2)])  # the context stays


def test_draft_trees_truncate_to_trees() -> None:
    tree = Draft(TOKENS, parents=PARENTS, reach=(0.9, 0.5, 0.4, 0.3, 0.2))
    assert tree.depth == 3
    assert tree.truncated(3) == Draft([3, 1, 2], parents=(-1, -1, 0), reach=(0.9, 0.5, 0.4))
    with pytest.raises(ValueError, match="before"):
        Draft([1, 2], parents=(1, -1))


def test_logprobs_through_trees_are_plain_decodings() -> None:
    """A request asking for log-probabilities gets, through tree steps, the tokens and
    log-probabilities plain decoding gives (each from its path row)."""
    from tests.factories import tiny_eagle_head, tiny_model
    from workers.drafting.eagle import EagleDrafter
    from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sampling_params import SamplingParams

    model = tiny_model(seed=4, max_position_embeddings=512)
    prompt = [5, 17, 33, 8, 60, 2, 71, 5, 17, 33]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    plain = LLMEngine(model, EngineConfig(max_model_len=512, block_size=8))
    want = plain.generate([prompt], params, RequestSpec(enabled=False))[0]
    spec = SpecConfig(method="eagle", adaptive=False, tree_nodes=8, disable_batch_size=64)
    drafter = EagleDrafter(tiny_eagle_head(model), model, num_blocks=64, block_size=8)
    trees = LLMEngine(
        model, EngineConfig(max_model_len=512, block_size=8, spec=spec), drafters={"eagle": drafter}
    )
    got = trees.generate([prompt], params, RequestSpec(method="eagle"))[0]
    assert drafter.trees.drafted > 0 and got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
