"""The device sampler's math on CPU tensors: the same committed tokens as the host reference for
greedy rows, the target's distribution for sampled ones (the chi-square tests of the host
sampler, over many keys), and counter-based random numbers that are uniform and depend only on
(key, counter, lane). Then the engine with the device sampler: greedy output equal to plain
decoding, and a seeded sampled request drawing the same alone or in a batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.counter_rng import hash32, hash32_int, key_of_seed, uniform
from kernels.rejection import PLACEHOLDER_TOKEN_ID, greedy_accept
from kernels.rejection_device import greedy_accept_batched, rejection_sample_batched
from kernels.sampling import row_sums
from tests.factories import tiny_model
from tests.model.helpers import plain_tokens, run_staggered
from tests.unit.helpers import run_interpreted
from tests.unit.test_cuda import GREEDY, SPEC, make_drafter, prompts, seeded_params
from tests.unit.test_rejection import (
    CHI2_CRITICAL_0_001,
    PAIRS,
    VOCAB,
    assert_first_tokens_follow,
    chi_square,
)
from workers.engine.config import EngineConfig, RequestSpec
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampler import DeviceSampler
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.kv_cache import BlockAllocator, BlockTable

P = PLACEHOLDER_TOKEN_ID


def test_greedy_rows_commit_what_the_host_reference_commits() -> None:
    gen = torch.Generator().manual_seed(0)
    num_seqs, max_k = 64, 5
    ks = torch.randint(0, max_k + 1, (num_seqs,), generator=gen)
    argmax = torch.randint(0, 4, (num_seqs, max_k + 1), generator=gen)
    drafts = torch.randint(0, 4, (num_seqs, max_k), generator=gen)
    drafts[torch.arange(max_k) >= ks.unsqueeze(1)] = P
    tokens, counts = greedy_accept_batched(drafts, ks, argmax)
    for n in range(num_seqs):
        k = int(ks[n])
        expected = greedy_accept(drafts[n, :k].tolist(), argmax[n, : k + 1].tolist())
        assert tokens[n, : len(expected)].tolist() == expected
        assert (tokens[n, len(expected) :] == P).all()
        assert int(counts[n]) == len(expected)


def run_trials(p: torch.Tensor, q: torch.Tensor | None, k: int, trials: int, seed: int):  # type: ignore[no-untyped-def]
    """Committed tokens of `trials` sequences with different keys; every position has target p."""
    gen = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = torch.randint(0, VOCAB, (trials, k), generator=gen)
        draft_probs = None
    else:
        drafts = torch.multinomial(
            q.expand(trials * k, VOCAB), 1, replacement=True, generator=gen
        ).view(trials, k)
        draft_probs = q.expand(trials, k, VOCAB)
    keys = torch.tensor([key_of_seed(seed * 1_000_003 + i) for i in range(trials)])
    tokens, _ = rejection_sample_batched(
        drafts,
        torch.full((trials,), k),
        draft_probs,
        None,
        p.expand(trials, k + 1, VOCAB),
        keys,
        torch.full((trials,), 17),
    )
    return tokens


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_committed_tokens_follow_the_target_distribution(name: str, one_hot_q: bool) -> None:
    p, q = PAIRS[name]
    out = run_trials(p, None if one_hot_q else q, k=3, trials=6000, seed=1 + len(name))
    assert_first_tokens_follow(out, p, name)


def test_rows_with_and_without_q_and_without_drafts_share_a_batch() -> None:
    """Ragged drafts, a one-hot row beside rows with q, a row with no draft: each row's first
    token still follows p."""
    p, q = PAIRS["q far from p"]
    trials = 4000
    ks = torch.tensor([3, 0, 2, 1] * (trials // 4))
    gen = torch.Generator().manual_seed(5)
    # Drafts drawn from q: what rows with q claim, and as good as any guess for one-hot rows.
    drafts = torch.multinomial(q.expand(trials * 3, VOCAB), 1, generator=gen).view(trials, 3)
    drafts[torch.arange(3) >= ks.unsqueeze(1)] = P
    has_q = torch.arange(trials) % 2 == 0
    tokens, counts = rejection_sample_batched(
        drafts,
        ks,
        q.expand(trials, 3, VOCAB).clone(),
        has_q,
        p.expand(trials, 4, VOCAB),
        torch.tensor([key_of_seed(i) for i in range(trials)]),
        torch.zeros(trials, dtype=torch.long),
    )
    assert bool((counts >= 1).all()) and bool((counts <= ks + 1).all())
    first = torch.bincount(tokens[:, 0], minlength=VOCAB).float()
    assert chi_square(first, p) < CHI2_CRITICAL_0_001[VOCAB - 1], first


def test_uniforms_are_uniform_and_depend_only_on_key_counter_and_lane() -> None:
    keys = torch.tensor([key_of_seed(s) for s in (0, 1, -1, 2**70)])
    u = uniform(keys, torch.tensor([0, 0, 5, 5]), torch.arange(20000))
    assert bool(((u > 0) & (u < 1)).all())
    counts = torch.histc(u.flatten(), bins=10, min=0, max=1)
    expected = torch.full((10,), u.numel() / 10)
    assert float(((counts - expected) ** 2 / expected).sum()) < 27.88  # chi2(9) at 0.001
    alone = uniform(keys[2:3], torch.tensor([5]), torch.arange(100, 200))
    assert torch.equal(alone, u[2:3, 100:200])  # no dependence on the batch
    assert not torch.equal(u[0], u[1])
    assert hash32(torch.tensor([12345])).item() == hash32_int(12345)


def test_engine_with_the_device_sampler() -> None:
    """Greedy output equal to plain decoding; a seeded sampled request the same alone or
    batched, with drafts (ngram, one-hot) and with q (a draft model)."""
    model = tiny_model(seed=4, max_position_embeddings=512)
    config = EngineConfig(max_model_len=512, block_size=8, spec=SPEC)

    def engine(method: str) -> LLMEngine:
        drafter = make_drafter(method, model)
        return LLMEngine(model, config, drafters={drafter.method: drafter}, sampler=DeviceSampler())

    prompt_ids = prompts(4, seed=8)
    expected = plain_tokens(model, (), prompt_ids, GREEDY)
    assert run_staggered(engine("ngram"), prompt_ids, GREEDY, RequestSpec(method="ngram")) == (
        expected
    )
    params = seeded_params(4)
    for method in ("ngram", "draft_model"):
        spec = RequestSpec(method=method)
        together = run_staggered(engine(method), prompt_ids, params, spec)
        pairs = zip(prompt_ids, params, strict=True)
        alone = [run_staggered(engine(method), [p], [sp], spec)[0] for p, sp in pairs]
        assert together == alone
        assert all(len(tokens) == 12 for tokens in together)


def test_a_batchs_transform_rows_are_made_again_when_its_sequences_change() -> None:
    """The device sampler keeps a batch's transform parameters while its sequences stay the
    same; the next batch of as many other sequences gets its own: greedy ones take their
    argmax, not a draw at the sampled ones' temperature, and the sampled ones then draw what
    a fresh sampler draws."""
    logits = torch.randn(2, 1, 50, generator=torch.Generator().manual_seed(3)) * 0.1
    no_drafts: list[tuple[int, ...]] = [(), ()]

    def seqs(params: SamplingParams) -> list[Sequence]:
        made = []
        for key in (11, 12):
            table = BlockTable(BlockAllocator(1), 16)
            made.append(Sequence(f"s{key}", [1, 2], params, "none", 0, table, None, 0))
            made[-1].rng_key = key
        return made

    sampled = seqs(SamplingParams(temperature=1.0, top_p=0.9))
    greedy = seqs(SamplingParams(temperature=0.0))
    sampler = DeviceSampler()
    drawn = sampler.sample(logits, no_drafts, [None, None], sampled)
    assert drawn == sampler.sample(logits, no_drafts, [None, None], sampled)  # kept
    argmax = [[int(t)] for t in logits[:, 0].argmax(dim=-1)]
    assert drawn != argmax
    assert sampler.sample(logits, no_drafts, [None, None], greedy) == argmax
    other = seqs(SamplingParams(temperature=1.0, top_p=0.9))
    assert sampler.sample(logits, no_drafts, [None, None], other) == drawn
    assert DeviceSampler().sample(logits, no_drafts, [None, None], sampled) == drawn


def check_row_sums(row_sums: Callable[[torch.Tensor], torch.Tensor], device: str) -> None:
    """Rows' sums as float64's rounded, and each row's bits alone or beside other rows."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(9, 3000, generator=gen)
    probs[:, ::7] = 0.0  # as masks leave them
    probs = probs.to(device)
    sums = row_sums(probs)
    want = probs.double().sum(-1, keepdim=True).float()
    torch.testing.assert_close(sums, want, rtol=1e-6, atol=0)
    for row in range(9):
        assert torch.equal(row_sums(probs[row : row + 1]), sums[row : row + 1])
    assert torch.equal(row_sums(probs[2:7]), sums[2:7])


def test_row_sums_are_the_same_bits_in_any_batch_interpreted() -> None:
    """The device sampler's renormalizing sums (kernels/sampling.py `row_sums`): on a GPU the
    batch-invariant kernel against a column of ones, here interpreted on the CPU."""
    pytest.importorskip("triton")
    run_interpreted(
        "import torch\n"
        "from kernels import batch_invariant\n"
        "from tests.unit.test_device_sampler import check_row_sums\n"
        "check_row_sums(lambda p: batch_invariant.linear(p, torch.ones(1, p.shape[1])), 'cpu')\n"
        "print('ok')\n",
        row_wise_dot=True,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_row_sums_are_the_same_bits_in_any_batch_on_cuda() -> None:
    check_row_sums(row_sums, "cuda")
