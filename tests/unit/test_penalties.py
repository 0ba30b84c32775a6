"""Repetition, frequency and presence penalties against a token-by-token reference, and their
per-row counts in a verify forward."""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import apply_penalties, position_counts
from workers.engine.sampling_params import SamplingParams


def reference(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> list[float]:
    """One position's penalized logits, a token at a time, as vLLM documents them."""
    out = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        logit -= frequency * output.count(token)
        logit -= presence * (token in output)
        out.append(logit)
    return out


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.5), (0.8, 1.5, 2.0)],
)
def test_penalties_match_the_reference_at_every_draft_position(
    repetition: float, frequency: float, presence: float
) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 12
    prompt, output, drafts = [0, 3, 3], [5, 7, 5], [7, 9, 1]
    logits = torch.randn(len(drafts) + 1, vocab, generator=generator) * 3
    params = SamplingParams(
        repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence
    )
    got = params.penalize(logits, prompt, output, drafts)
    for j in range(len(drafts) + 1):
        expected = reference(
            logits[j].tolist(), prompt, output + drafts[:j], repetition, frequency, presence
        )
        torch.testing.assert_close(got[j], torch.tensor(expected))


def test_position_counts_take_in_the_drafts_before_each_row() -> None:
    counts = position_counts([2, 2, 1], [1, 3], vocab=4)
    assert counts.tolist() == [[0, 1, 2, 0], [0, 2, 2, 0], [0, 2, 2, 1]]
    assert position_counts([], [], vocab=3).tolist() == [[0, 0, 0]]


def test_no_penalty_leaves_logits_alone() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    counts = torch.tensor([[1.0, 1.0, 0.0]])
    same = apply_penalties(logits, counts, torch.tensor([True, True, True]), 1.0, 0.0, 0.0)
    assert torch.equal(same, logits)
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.1).penalized


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.1},
    ],
)
def test_out_of_range_penalties_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**fields)  # type: ignore[arg-type]
