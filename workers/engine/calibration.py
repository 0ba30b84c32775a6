"""What a forward costs on this machine, measured at start-up for adaptive speculation.

Verifying k drafts is one forward over k + 1 tokens. How that compares with a one-token forward
depends on the hardware: on a CPU in bf16, one row takes a GEMV path and two rows already a GEMM
(+25% here), after which more rows are nearly free; on a GPU the curve stays flat far longer.
So the engine measures it instead of assuming it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.transformer import TransformerLM


def forward_times(
    model: TransformerLM, counts: Sequence[int], reps: int, context: int = 128
) -> list[float]:
    """Median seconds of one forward bringing n new tokens onto a `context`-token cache, for
    each n in `counts`."""
    return [statistics.median(t) for t in forward_samples(model, counts, reps, context)]


def forward_samples(
    model: TransformerLM, counts: Sequence[int], reps: int, context: int = 128
) -> list[list[float]]:
    """Seconds of `reps` forwards bringing n new tokens onto a `context`-token cache, for each n
    in `counts` (entry [i][r]: counts[i] in round r). Rounds go over all counts in turn, so
    machine noise that lasts a round lands on all alike; a warm-up round is dropped."""
    block_size = 16
    num_blocks = -(-(context + max(counts)) // block_size)
    cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
    runner = ModelRunner(model, cache)
    table = BlockTable(BlockAllocator(num_blocks), block_size)
    table.prepare_write(0, context + max(counts))
    vocab = model.config.vocab_size
    runner.forward([SeqForward([(i * 7919) % vocab for i in range(context)], 0, table.block_ids)])
    seqs = [
        SeqForward(
            [(context + i) % vocab for i in range(n)], context, table.block_ids, num_logits=n
        )
        for n in counts
    ]
    samples: list[list[float]] = [[] for _ in seqs]
    for _ in range(reps + 1):
        for seq, times in zip(seqs, samples, strict=True):
            start = time.perf_counter()
            runner.forward([seq])
            times.append(time.perf_counter() - start)
    return [t[1:] for t in samples]


@torch.inference_mode()
def verify_costs(model: TransformerLM, max_tokens: int, reps: int = 5) -> tuple[float, ...]:
    """Cost of a forward over n = 1..max_tokens new tokens in one-token forwards (entry n - 1):
    verifying k drafts of one sequence is n = k + 1, a batch's step the sum over its sequences.
    Measured at 1, 2, 4, 8, ... and max_tokens, linear in between. Each count's cost is the
    median over rounds of its time over the one-token forward's in the same round: on a busy
    machine the absolute times of separate medians can disagree by half (seen on 2 cores)."""
    counts = sorted(
        {1, max_tokens} | {2**i for i in range(max_tokens.bit_length()) if 2**i < max_tokens}
    )
    samples = dict(zip(counts, forward_samples(model, counts, reps), strict=True))
    ratio = {
        n: statistics.median(t / one for t, one in zip(samples[n], samples[1], strict=True))
        for n in counts
    }
    costs = []
    for n in range(1, max_tokens + 1):
        hi = next(c for c in counts if c >= n)
        lo = max(c for c in counts if c <= n)
        r = ratio[lo] if hi == lo else ratio[lo] + (ratio[hi] - ratio[lo]) * (n - lo) / (hi - lo)
        costs.append(max(1.0, r))
    return tuple(costs)


@torch.inference_mode()
def relative_token_cost(draft: TransformerLM, target: TransformerLM, reps: int = 3) -> float:
    """A draft-model token's cost in target one-token forwards."""
    draft_s = forward_times(draft, [1], reps)[0]
    target_s = forward_times(target, [1], reps)[0]
    return draft_s / target_s
