"""Sampling transforms against direct computations."""

from __future__ import annotations

import pytest
import torch

import kernels.sampling
from kernels.sampling import draw, draw_rows, logits_to_probs, sample_from_probs


def transform(
    logits: torch.Tensor, t: float = 1.0, k: int = 0, p: float = 1.0, m: float = 0.0
) -> torch.Tensor:
    n = logits.shape[0]
    return logits_to_probs(
        logits,
        torch.full((n,), t),
        torch.full((n,), k, dtype=torch.long),
        torch.full((n,), p),
        torch.full((n,), m),
    )


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])


def test_temperature_scales_logits() -> None:
    torch.testing.assert_close(transform(LOGITS, t=0.5), torch.softmax(LOGITS / 0.5, -1))


def test_greedy_is_one_hot_on_argmax() -> None:
    assert transform(LOGITS, t=0.0).tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]


def test_top_k_keeps_the_k_largest() -> None:
    probs = transform(LOGITS, k=2)
    expected = torch.softmax(torch.tensor([[2.0, -1e9, -1e9, -1e9, 3.0]]), -1)
    torch.testing.assert_close(probs, expected)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    base = torch.softmax(LOGITS, -1)[0]  # order: 4, 0, 1, 2, 3
    first_two = float(base[4] + base[0])
    probs = transform(LOGITS, p=first_two - 1e-4)[0]
    assert (probs > 0).tolist() == [True, False, False, False, True]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    # The top token survives even with a tiny p.
    assert (transform(LOGITS, p=1e-6)[0] > 0).tolist() == [False, False, False, False, True]


def test_top_p_keeps_the_tokens_tied_with_the_last_one_kept() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 1.0, 1.0, 0.0]])
    base = torch.softmax(logits, -1)[0]
    # The prefix reaching p ends at the first 1.0; its ties stay whatever order a sort gives.
    probs = transform(logits, p=float(base[0] + base[2]) + 1e-3)[0]
    assert (probs > 0).tolist() == [True, True, True, True, True, False]


def reference_top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Row by row over the whole sorted row: the value of the last token of the smallest prefix
    whose mass before a token reaches top_p (the mass summed as the kernel sums it)."""
    floors = []
    for row, p in zip(probs, top_p.tolist(), strict=True):
        values = row.sort(descending=True).values
        before = (values.cumsum(0) - values).tolist()
        end = next((i for i, mass in enumerate(before) if mass >= p), len(before))
        floors.append(values[end - 1])
    return torch.stack(floors).unsqueeze(1)


def test_top_p_from_candidates_is_the_whole_rows_sort() -> None:
    """The CPU's top-p looks at a row's likeliest 48, 256 and 2,048 before sorting it whole: for
    peaked rows, flat ones (past every candidate count), ties from bf16 logits and small and
    large p in one batch, the floor is the whole sort's, bit for bit, and the mask keeps what
    is at least the floor."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.1, 1.0, 3.0, 8.0, 20.0]).repeat_interleave(8)
    logits = (torch.randn(40, 4096, generator=gen) * scales.unsqueeze(1)).bfloat16().float()
    probs = torch.softmax(logits, -1)
    top_p = torch.rand(40, generator=gen) * 0.99 + 0.005
    floor = kernels.sampling.top_p_floor(probs, top_p, kernels.sampling.TOP_P_CANDIDATES)
    assert torch.equal(floor, reference_top_p_floor(probs, top_p))
    assert torch.equal(floor, kernels.sampling.top_p_floor(probs, top_p))
    kept = transform(logits, p=0.9) > 0
    assert torch.equal(kept, probs >= reference_top_p_floor(probs, torch.full((40,), 0.9)))


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    base = torch.softmax(LOGITS, -1)[0]
    ratio = float(base[1] / base[4])  # token 1 sits exactly at the threshold and stays
    probs = transform(LOGITS, m=ratio)[0]
    assert (probs > 0).tolist() == [True, True, False, False, True]


def test_rows_use_their_own_parameters() -> None:
    logits = LOGITS.repeat(2, 1)
    probs = logits_to_probs(
        logits,
        torch.tensor([0.0, 1.0]),
        torch.tensor([0, 2]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.0]),
    )
    assert probs[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert (probs[1] > 0).tolist() == [True, False, False, False, True]


def test_a_rows_probabilities_do_not_depend_on_its_batch() -> None:
    """A row without top-p or min-p is not renormalized because another row uses them: its
    probabilities are the bits it gets alone (a seeded request draws the same tokens whoever
    shares its step)."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = (
        torch.tensor([0.8, 0.7, 1.0, 0.0]),  # temperature (the last row greedy)
        torch.tensor([0, 50, 0, 0]),  # top-k
        torch.tensor([1.0, 0.9, 0.95, 1.0]),  # top-p
        torch.tensor([0.0, 0.0, 0.05, 0.0]),  # min-p
    )
    batch = logits_to_probs(logits, *params)
    for i in range(4):
        alone = logits_to_probs(logits[i : i + 1], *(p[i : i + 1] for p in params))
        assert torch.equal(alone[0], batch[i]), i


def test_seeded_sampling_is_reproducible_and_follows_probs() -> None:
    probs = torch.tensor([[0.2, 0.0, 0.8]]).repeat(4000, 1)
    gens = [torch.Generator().manual_seed(7)] * 4000
    draws = sample_from_probs(probs, gens)
    again = sample_from_probs(probs, [torch.Generator().manual_seed(7)] * 4000)
    assert 1 not in draws.tolist()
    freq = float((draws == 2).float().mean())
    assert abs(freq - 0.8) < 0.03
    first = sample_from_probs(probs[:1], [torch.Generator().manual_seed(11)])
    assert torch.equal(first, sample_from_probs(probs[:1], [torch.Generator().manual_seed(11)]))
    assert draws.shape == again.shape


def test_draw_follows_unnormalized_weights() -> None:
    """A chi-square test of 40,000 draws against weights that do not sum to 1 (a residual
    max(0, p - q) is drawn from as it is), zeros included, at a 1e-4 false-alarm rate."""
    weights = torch.tensor([0.0, 3.0, 0.5, 0.0, 1.5, 2.0, 0.0, 0.01])
    gen = torch.Generator().manual_seed(3)
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=8)
    assert counts[weights == 0].sum() == 0
    expected = n * weights / weights.sum()
    kept = weights > 0
    chi2 = float((((counts[kept] - expected[kept]) ** 2) / expected[kept]).sum())
    assert chi2 < 25.7  # 99.99th percentile of chi-square with 4 degrees of freedom


def test_draw_is_seeded_and_uses_the_global_rng_without_a_generator() -> None:
    probs = torch.softmax(torch.randn(49152, generator=torch.Generator().manual_seed(0)), -1)
    first = [draw(probs, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(first)) == 1
    gen = torch.Generator().manual_seed(5)
    run = [draw(probs, gen) for _ in range(20)]
    gen = torch.Generator().manual_seed(5)
    assert run == [draw(probs, gen) for _ in range(20)]
    torch.manual_seed(9)
    unseeded = draw(probs)
    torch.manual_seed(9)
    assert draw(probs) == unseeded


def test_draw_at_the_top_of_the_range_takes_the_last_weighted_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """u * total may round up to the total; the draw then falls past the cumulative sum and
    must land on the last token with weight, never on a zero-weight one past it."""

    def top(*args: object, **kwargs: object) -> torch.Tensor:
        return torch.ones(1, dtype=torch.float64)

    monkeypatch.setattr(kernels.sampling.torch, "rand", top)
    assert draw(torch.tensor([0.5, 0.0, 0.25, 0.0, 0.0])) == 2
    monkeypatch.setattr(
        kernels.sampling.torch, "rand", lambda n, **kwargs: torch.ones(n, dtype=torch.float64)
    )
    weights = torch.tensor([[0.5, 0.0, 0.25, 0.0, 0.0], [0.0, 0.1, 0.0, 0.0, 0.0]])
    assert draw_rows(weights, [None, torch.Generator()]) == [2, 1]


def test_draw_rows_draws_what_each_row_drawn_alone_does() -> None:
    """The batch's draws in one pass: seeded rows from their own generators, the others from
    the global RNG in row order, the same tokens as `draw` one row at a time."""
    weights = torch.rand(9, 300, generator=torch.Generator().manual_seed(1)) ** 4
    weights[3, 100:] = 0.0  # a row whose weight ends early

    def generators() -> list[torch.Generator | None]:
        return [None if i % 3 == 0 else torch.Generator().manual_seed(i) for i in range(9)]

    torch.manual_seed(4)
    together = draw_rows(weights, generators())
    torch.manual_seed(4)
    assert together == [draw(w, g) for w, g in zip(weights, generators(), strict=True)]
