"""What an EAGLE drafter's drafts cost, measured at start-up for the speculator's prices.

`token_seconds` times proposals for made-up sequences (random features, a `context`-row
history): one token for one sequence (a one-row head forward and its draft-vocabulary logits),
and with `rows` > 1 what each further sequence drafting at once adds (`row_seconds`: a depth's
forward serves them all, its host work is per row). With the draft loop, a proposal's fixed
part (staging, launch, read-back: `launch_seconds`) is told from what each depth adds, which
is the token's price, by timing the loop's shallowest and deepest drafts.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from workers.drafting.base import DraftRequest
from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.drafting.eagle import EagleDrafter


@torch.inference_mode()
def token_seconds(drafter: EagleDrafter, context: int, reps: int, rows: int) -> float:
    """Median seconds of one draft token for one sequence (with the loop: what a depth adds);
    sets the drafter's `launch_seconds` and `row_seconds` where it measures them."""
    one = proposal_seconds(drafter, context, reps, 1)
    loop = drafter.loop
    if loop is not None and loop.max_depth > 1:
        deep = proposal_seconds(drafter, context, reps, 1, loop.max_depth)
        depth = max(0.0, (deep - one) / (loop.max_depth - 1))
        drafter.launch_seconds = max(0.0, one - depth)
        one = depth
    if rows > 1:
        batch = proposal_seconds(drafter, context, reps, rows)
        single = one + (drafter.launch_seconds or 0.0)
        drafter.row_seconds = max(0.0, (batch - single) / (rows - 1))
    return one


def proposal_seconds(
    drafter: EagleDrafter, context: int, reps: int, rows: int, k: int = 1, tree_nodes: int = 0
) -> float:
    """Median seconds of a `k`-token proposal (a tree of `tree_nodes`, if any) for `rows`
    sequences at once."""
    rids = [f"__calibration_{i}__" for i in range(rows)]
    lookup, drafter.lookup = drafter.lookup, None  # time the head, not a lookup
    try:
        width = len(drafter.hidden_layers) * drafter.head.config.target_hidden_size
        features = torch.randn(context, width, generator=torch.Generator().manual_seed(0))
        for rid in rids:
            drafter.add(rid, [0] * (context + 1), SamplingParams(temperature=0.0))
            drafter.observe_hidden(rid, 0, features.to(drafter.cache.data.dtype))
        request = [DraftRequest(rid, context + 1, k, tree_nodes) for rid in rids]
        drafter.propose(request)  # the history; later calls redo only the last row
        times = []
        device = drafter.cache.data.device
        for _ in range(reps + 1):
            start = time.perf_counter()
            drafter.propose(request)
            if device.type == "cuda":  # the draft's kernels must have run, not just launched
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        for rid in rids:
            drafter.remove(rid)
        drafter.lookup = lookup
