"""Checks shared by the unit tests of several drafters."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]


# The interpreter's `tl.dot` with each row of the tile computed alone. The interpreter calls
# numpy's matmul, whose BLAS may round a row differently by where it sits in the tile: on a Zen 5
# VM OpenBLAS's default kernels do (as its Haswell and Zen ones do; its SkylakeX and Cooperlake
# ones do not); a GPU's MMA instructions do not. Checks of a row's bits across batches need it.
ROW_WISE_DOT = """
import numpy as np
from triton.runtime import interpreter

def _row_wise_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    rows = [np.matmul(row[None], b.data, dtype=d.data.dtype)[0] for row in a.data]
    return interpreter.TensorHandle(np.stack(rows) + d.data, d.dtype.scalar)

interpreter.InterpreterBuilder.create_dot = _row_wise_dot
"""


def run_interpreted(code: str, row_wise_dot: bool = False) -> None:
    """Run `code` (which prints "ok" when its checks pass) in a subprocess under Triton's
    interpreter: on the CPU, and never cached in a process that has a GPU. `row_wise_dot`:
    with `ROW_WISE_DOT`, for checks of bits across batches."""
    code = ROW_WISE_DOT + code if row_wise_dot else code
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
