"""Checks shared by the unit tests of several drafters."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.drafting.base import Draft, Drafter, DraftRequest
from workers.engine.sampling_params import SamplingParams


def draft_ends_where_its_probability_falls_below_the_bar(
    make: Callable[[float], Drafter], prompt: list[int], setup: Callable[[Drafter], None]
) -> None:
    """Shared by draft_model and eagle (tests/unit/test_eagle.py): a seeded sampled draft of k
    tokens; the same seed under a bar between the draft's probability after its second and
    third tokens gives the first three tokens and their q; greedy under a bar no draft meets
    gives one token."""
    k, params = 6, SamplingParams(temperature=0.9, seed=3)
    request = [DraftRequest("a", len(prompt), k)]

    def drafted(bar: float, params: SamplingParams) -> Draft:
        drafter = make(bar)
        drafter.add("a", prompt, params)
        setup(drafter)
        return drafter.propose(request)["a"]

    whole = drafted(0.0, params)
    assert whole.probs is not None and len(whole.token_ids) == k
    chosen = whole.probs[torch.arange(k), torch.tensor(whole.token_ids)]
    confidence = torch.cumprod(chosen.double(), 0)
    assert float(confidence[1]) > float(confidence[2])
    bar = float(confidence[1] + confidence[2]) / 2
    short = drafted(bar, params)
    assert short.token_ids == whole.token_ids[:3]
    assert short.probs is not None and torch.equal(short.probs, whole.probs[:3])
    greedy = SamplingParams(temperature=0.0)
    assert len(drafted(0.0, greedy).token_ids) == k
    assert len(drafted(1 - 1e-9, greedy).token_ids) == 1  # a tiny model is never that sure
