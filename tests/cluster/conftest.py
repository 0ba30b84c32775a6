"""Fixtures of the runtime tests: the prompts and their plain-decoding outputs (fp32)."""

from __future__ import annotations

import pytest

from tests.cluster.common import GREEDY, TEXTS
from workers.engine.sequential import SequentialEngine


@pytest.fixture(scope="session")
def prompts(checkpoint) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [checkpoint.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="session")
def expected(model_fp32, checkpoint, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    plain = SequentialEngine(
        model_fp32, eos_token_ids=checkpoint.config.eos_token_ids, max_model_len=512
    )
    return [plain.generate(p, GREEDY).token_ids for p in prompts]
