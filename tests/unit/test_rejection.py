"""Rejection sampler: exact greedy cases and the target distribution, statistically."""

from __future__ import annotations

import pytest
import torch

from kernels.rejection import PLACEHOLDER_TOKEN_ID, greedy_accept, rejection_sample
from kernels.sampling import draw, logits_to_probs
from workers.drafting.base import ConfidenceStop

P = PLACEHOLDER_TOKEN_ID
# Chi-square critical values at significance 0.001 by degrees of freedom.
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
CHI2_CRITICAL_0_001[15] = 37.70


def one_hot_probs(rows: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), vocab).float()


def greedy_case(drafts: list[list[int]], target_argmax: list[list[int]]) -> list[list[int]]:
    max_k = max(len(d) for d in drafts)
    padded = torch.tensor([d + [P] * (max_k - len(d)) for d in drafts])
    target = torch.stack([one_hot_probs(t + [0] * (max_k + 1 - len(t))) for t in target_argmax])
    n = len(drafts)
    out = rejection_sample(
        padded, [len(d) for d in drafts], [None] * n, target, [True] * n, [None] * n
    )
    return out.tolist()


def test_greedy_perfect_match_gets_the_bonus_token() -> None:
    assert greedy_case([[1, 2, 3]], [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_stops_with_the_target_token() -> None:
    assert greedy_case([[1, 5, 3]], [[1, 2, 3, 4]]) == [[1, 2, P, P]]
    assert greedy_case([[7, 2, 3]], [[1, 2, 3, 4]]) == [[1, P, P, P]]


def test_greedy_ragged_batch_and_no_draft() -> None:
    out = greedy_case([[1, 2], [], [3, 3, 3]], [[1, 2, 6], [5], [3, 4, 3, 0]])
    assert out == [[1, 2, 6, P], [5, P, P, P], [3, 4, P, P]]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def transformed(logits: list[float], temperature: float, top_p: float) -> torch.Tensor:
    row = torch.tensor([logits])
    one = torch.ones(1)
    return logits_to_probs(
        row, one * temperature, torch.zeros(1, dtype=torch.long), one * top_p, 0 * one
    )[0]


VOCAB = 6
PAIRS = {
    # p, q: several shapes of disagreement, some after temperature/top-p transforms.
    "q equals p": (
        torch.tensor([0.3, 0.2, 0.2, 0.1, 0.1, 0.1]),
        torch.tensor([0.3, 0.2, 0.2, 0.1, 0.1, 0.1]),
    ),
    "q far from p": (
        torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]),
        torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]),
    ),
    "top-p and temperature": (
        transformed([2.0, 1.5, 1.0, 0.2, -1.0, -3.0], 0.7, 0.9),
        transformed([0.5, 2.5, 1.0, 0.9, 0.0, -1.0], 0.7, 0.9),
    ),
    "hot temperature": (
        transformed([2.0, 1.5, 1.0, 0.2, -1.0, -3.0], 1.5, 1.0),
        transformed([-1.0, 0.0, 3.0, 0.2, 1.0, 0.5], 1.5, 1.0),
    ),
}


def run_trials(
    p: torch.Tensor, q: torch.Tensor | None, k: int, trials: int, seed: int
) -> torch.Tensor:
    """Committed tokens of `trials` independent sequences; every position has target p."""
    gen = torch.Generator().manual_seed(seed)
    if q is None:  # a deterministic drafter: its guess, a one-hot q
        drafts = torch.randint(0, VOCAB, (trials, k), generator=gen)
        draft_probs: list[torch.Tensor | None] = [None] * trials
    else:
        drafts = torch.multinomial(
            q.expand(trials * k, VOCAB), 1, replacement=True, generator=gen
        ).view(trials, k)
        draft_probs = [q.expand(k, VOCAB)] * trials
    target = p.expand(trials, k + 1, VOCAB)
    gens = [torch.Generator().manual_seed(seed * 100003 + i) for i in range(trials)]
    return rejection_sample(drafts, [k] * trials, draft_probs, target, [False] * trials, gens)


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("one_hot_q", [False, True])
def test_committed_tokens_follow_the_target_distribution(name: str, one_hot_q: bool) -> None:
    p, q = PAIRS[name]
    out = run_trials(p, None if one_hot_q else q, k=3, trials=6000, seed=1 + len(name))
    assert_first_tokens_follow(out, p, name)


def assert_first_tokens_follow(out: torch.Tensor, p: torch.Tensor, name: str) -> None:
    """The first and (where committed) second token of each row `out` are distributed as p."""
    support = int((p > 0).sum())
    for position in range(2):
        column = out[:, position]
        column = column[column != P]
        counts = torch.bincount(column, minlength=VOCAB).float()
        assert counts[p == 0].sum() == 0, "a token the target gives zero probability was emitted"
        assert chi_square(counts, p) < CHI2_CRITICAL_0_001[support - 1], (name, position, counts)


# A chain over 4 tokens where each token's distribution depends on the one before: the target's
# (rows of MARKOV_P) and a drafter's that is sure of itself after some tokens and unsure after
# others (MARKOV_Q), so that drafts stopped by confidence come in every length.
MARKOV_P = torch.tensor(
    [[0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]
)
MARKOV_Q = torch.tensor(
    [[0.05, 0.9, 0.03, 0.02], [0.3, 0.3, 0.2, 0.2], [0.1, 0.1, 0.1, 0.7], [0.85, 0.05, 0.05, 0.05]]
)


def test_drafts_stopped_by_confidence_keep_the_target_distribution() -> None:
    """Whole sequences, step after step as the engine runs them: each step drafts from where
    the last one ended until the drafter's probability of its draft falls below the bar
    (ConfidenceStop, what draft_model and eagle use), then rejection-samples. The first two
    committed tokens must follow the target chain jointly, p(x1) p(x2 | x1)."""
    gen = torch.Generator().manual_seed(11)
    trials, k, start = 6000, 4, 0
    lengths = torch.zeros(k + 1)
    counts = torch.zeros(4, 4)
    for trial in range(trials):
        verify_gen = torch.Generator().manual_seed(1000 + trial)
        committed: list[int] = []
        while len(committed) < 2:
            prev = committed[-1] if committed else start
            drafts, stop = [], ConfidenceStop(0.4)
            while len(drafts) < k:
                q = MARKOV_Q[drafts[-1] if drafts else prev]
                token = int(torch.multinomial(q, 1, generator=gen))
                drafts.append(token)
                stop.drew(float(q[token]))
                if not stop.sure:
                    break
            lengths[len(drafts)] += 1
            contexts = torch.tensor([prev, *drafts])
            out = rejection_sample(
                torch.tensor([drafts], dtype=torch.long),
                [len(drafts)],
                [MARKOV_Q[contexts[:-1]]],
                MARKOV_P[contexts].unsqueeze(0),
                [False],
                [verify_gen],
            )[0]
            committed += [t for t in out.tolist() if t != P]
        counts[committed[0], committed[1]] += 1
    assert all(lengths[n] > 100 for n in range(1, k + 1)), lengths  # every length drafted
    joint = MARKOV_P[start][:, None] * MARKOV_P
    assert chi_square(counts.flatten(), joint.flatten()) < CHI2_CRITICAL_0_001[15], counts


def test_accepts_everything_when_q_equals_p_one_hot() -> None:
    p = one_hot_probs([2])[0][:VOCAB]
    out = run_trials(p, p, k=4, trials=200, seed=3)
    assert (out == 2).all()


def test_acceptance_rate_matches_theory() -> None:
    # Expected acceptance of one draft: sum_x min(p(x), q(x)).
    p, q = PAIRS["q far from p"]
    out = run_trials(p, q, k=1, trials=8000, seed=9)
    # With k = 1 a row holds 2 tokens iff the draft was accepted.
    accepted = float((out[:, 1] != P).float().mean())
    assert abs(accepted - float(torch.minimum(p, q).sum())) < 0.02


def test_inputs_must_agree_in_shape() -> None:
    with pytest.raises(ValueError, match="one k"):
        rejection_sample(
            torch.zeros(2, 1, dtype=torch.long), [1], [None], torch.ones(2, 2, 3), [True], [None]
        )
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(
            torch.zeros(1, 2, dtype=torch.long), [2], [None], torch.ones(1, 2, 3), [True], [None]
        )


def test_greedy_accept_needs_only_the_argmax() -> None:
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # stops at the first mismatch
    assert greedy_accept([], [3]) == [3]  # no draft: the argmax
    with pytest.raises(ValueError):
        greedy_accept([5], [5])


def test_rows_without_a_draft_draw_from_the_target_beside_rows_with_one() -> None:
    """A sampled row with k = 0 draws its one token from p (as `draw` does with its seed),
    padded to the widest row, beside a greedy row and a sampled row with drafts."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 3, 8, generator=gen), dim=-1)
    drafts = torch.tensor([[P, P], [4, 5], [P, P]])
    ks = [0, 2, 0]
    q = torch.softmax(torch.randn(2, 8, generator=gen), dim=-1)
    seeds = [torch.Generator().manual_seed(s) for s in (7, 8, 9)]
    out = rejection_sample(drafts, ks, [None, q, None], p, [False, False, True], seeds)
    assert out.shape == (3, 3)
    assert out[0].tolist() == [draw(p[0, 0], torch.Generator().manual_seed(7)), P, P]
    assert out[2].tolist() == [int(p[2, 0].argmax()), P, P]
    assert P not in out[1, :1].tolist()
    empty = rejection_sample(torch.empty(0, 2, dtype=torch.long), [], [], p[:0], [], [])
    assert empty.shape == (0, 3)
