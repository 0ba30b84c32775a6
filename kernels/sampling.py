"""Sampling transforms: logits to the probabilities a token is drawn from.

The same transform (temperature, then top-k, top-p, min-p, in that order as transformers applies
them) is applied to target and draft distributions, so the rejection test compares like with like.
A row with temperature 0 is greedy: its distribution is one-hot on the argmax.

A row's probabilities are the same bits in any batch: a row that does not use top-p or min-p
keeps its softmax as it is, rather than going through the mask and the renormalization (a sum
of about 1 that moves the last bits) because another row in the batch uses them. So a seeded
request draws the same tokens whoever shares its step.

Top-k and top-p keep every token tied with the last one kept (a threshold on the value, not a
position in a sorted order), so which of equal values a sort puts first decides nothing. Neither
sorts the whole vocabulary on a CPU where a few candidates settle it: sorting a 49,152-token row
there costs ~2 ms, a fifth of a decode step, while a language model's nucleus is a few dozen tokens
(docs/benchmarks.md, "Top-p over the whole vocabulary"). Top-k takes the k largest values; top-p
takes the largest 48, then 256, then 2,048, and sorts only the rows still short of their mass,
with the same sums.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import batch_invariant


@dataclass(frozen=True, slots=True)
class TransformUse:
    """Which parts of the transform any row uses, known on the host (from the requests'
    settings), so that a GPU batch skips the unused parts without asking the device."""

    greedy: bool
    top_k: bool
    top_p: bool
    min_p: bool


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    temperature: torch.Tensor,  # [num_rows] fp32, 0 = greedy
    top_k: torch.Tensor,  # [num_rows] int64, 0 = off
    top_p: torch.Tensor,  # [num_rows] fp32, 1 = off
    min_p: torch.Tensor,  # [num_rows] fp32, 0 = off
    uses: TransformUse | None = None,  # None: read off the tensors (a sync on a GPU)
) -> torch.Tensor:  # [num_rows, vocab] fp32, rows sum to 1
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if uses is None or uses.top_k:
        scaled = _mask_top_k(scaled, top_k, check=uses is None)
    probs = torch.softmax(scaled, dim=-1)
    if uses is None or uses.top_p:
        probs = _mask_top_p(probs, top_p, check=uses is None)
    if uses is None or uses.min_p:
        probs = _mask_min_p(probs, min_p, check=uses is None)
    if bool(greedy.any()) if uses is None else uses.greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, check: bool = True) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    if check and bool((k == vocab).all()):
        return logits
    if logits.device.type == "cpu":  # a sort's first values, ties and all
        largest = logits.topk(int(k.max()), dim=-1).values
    else:  # nothing read back: a device's sampler runs on without waiting for it
        largest = logits.sort(dim=-1, descending=True).values
    kth = largest.gather(1, (k - 1).unsqueeze(1))  # [num_rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


# How many of a row's likeliest tokens top-p looks at, in turn, before it sorts the row: the
# bundled model's nucleus at temperature 0.8 and top-p 0.95 is 3 tokens at the median, 29 at the
# 90th percentile and within 256 in nearly all steps. Over the whole vocabulary (49,152 tokens)
# starting at 48 rather than 16 settles more rows with the first top-k (each costs a pass over
# the row) and took 15-25% off the transform of 1 to 256 rows on the 2-core VM. (Over rows of
# 1,024, a top-k of at most 16 has a faster path, and 16 then 64 is quicker at 64 rows and more.)
TOP_P_CANDIDATES = (48, 256, 2048)


def _mask_top_p(probs: torch.Tensor, top_p: torch.Tensor, check: bool = True) -> torch.Tensor:
    used = top_p < 1
    if check and not bool(used.any()):
        return probs
    if probs.device.type != "cpu":  # every row sorted: nothing read back from the device
        floor = torch.where(used.unsqueeze(1), top_p_floor(probs, top_p), 0.0)
        return _renormalize_rows(probs, probs < floor, used)
    if bool(used.all()):  # no copy of the rows
        floor = top_p_floor(probs, top_p, TOP_P_CANDIDATES)
    else:
        floor = torch.zeros(probs.shape[0], 1, dtype=probs.dtype)
        rows = used.nonzero().squeeze(1)
        floor[rows] = top_p_floor(probs[rows], top_p[rows], TOP_P_CANDIDATES)
    return _renormalize_rows(probs, probs < floor, used)


def top_p_floor(
    probs: torch.Tensor,  # [num_rows, vocab]
    top_p: torch.Tensor,  # [num_rows]
    candidates: Sequence[int] = (),
) -> torch.Tensor:  # [num_rows, 1]
    """Each row's least kept probability under top-p: that of the last token of the smallest
    prefix of the row, most likely first, whose mass reaches top_p (a token is in it if the
    mass before it is still short of top_p; the most likely token always is). Ties with it are
    kept too. `candidates`: how many of the likeliest tokens to try before sorting a row whole
    (each count reads back whether every row is settled); a prefix's sums are the same either
    way on a CPU, whose cumulative sums run in order."""
    num_rows, vocab = probs.shape
    floor = torch.zeros(num_rows, 1, dtype=probs.dtype, device=probs.device)
    pending = torch.arange(num_rows, device=probs.device)  # the rows not yet settled
    for count in (*(c for c in candidates if c < vocab), vocab):
        whole = pending.shape[0] == num_rows
        rows, p = (probs, top_p) if whole else (probs[pending], top_p[pending])
        if count == vocab:
            largest = rows.sort(dim=-1, descending=True).values
        else:
            largest = rows.topk(count, dim=-1).values
        reached = (largest.cumsum(dim=-1) - largest) >= p.unsqueeze(1)
        found = reached.any(dim=-1)
        # The first position whose mass before reaches top_p ends the prefix (none: the row).
        end = torch.where(found, reached.int().argmax(dim=-1), count)
        least = largest.gather(1, (end - 1).unsqueeze(1))
        if whole:
            floor = least
        else:
            floor[pending] = least
        if count == vocab or bool(found.all()):
            break
        pending = pending[~found]
    return floor


def _mask_min_p(probs: torch.Tensor, min_p: torch.Tensor, check: bool = True) -> torch.Tensor:
    used = min_p > 0
    if check and not bool(used.any()):
        return probs
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return _renormalize_rows(probs, probs < threshold, used)


def _renormalize_rows(
    probs: torch.Tensor,  # [num_rows, vocab]
    drop: torch.Tensor,  # [num_rows, vocab] bool: tokens the mask drops
    used: torch.Tensor,  # [num_rows] bool: rows that use the mask
) -> torch.Tensor:
    """The rows that use a mask with its tokens dropped and renormalized, in place (`drop`
    drops nothing in the other rows, which stay as they were, bit for bit: x / 1 is x). One
    pass each and no new tensor of the batch's size: on a CPU a fresh one page-faults."""
    probs.masked_fill_(drop, 0.0)
    return probs.div_(torch.where(used.unsqueeze(1), row_sums(probs), 1.0))


def row_sums(probs: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows, 1]
    """Each row's sum, the same bits whatever rows come with it. On a GPU torch's reduction
    splits a row over more blocks the fewer rows there are, so its partial sums meet in an
    order set by the batch (a seeded request's draw could then change with its neighbours,
    against `--deterministic`'s promise); there the sum is the fixed-tile GEMM of
    kernels/batch_invariant.py against a column of ones. A CPU's sum runs each row alone."""
    ones = _ones(probs.shape[1], probs.dtype, probs.device)
    if probs.is_cuda and batch_invariant.problem(probs, ones) is None:
        return batch_invariant.linear(probs, ones)
    return probs.sum(dim=-1, keepdim=True)


@functools.cache
def _ones(vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [1, vocab]
    return torch.ones(1, vocab, dtype=dtype, device=device)


def draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index of `weights` (`[vocab]`, >= 0, not all 0), drawn with probability in proportion
    to its weight from `generator` (else the global RNG): the inverse of the cumulative weights,
    in fp64, at one uniform draw.

    The same law as `torch.multinomial(weights, 1)`, which costs ~1 ms on the CPU for a 49k
    vocabulary against ~0.08 ms here (tests/benchmarks/bench_forward.py), and which
    draws other numbers from the generator: a seed gives other tokens than it did with it.
    """
    return draw_rows(weights.view(1, -1), [generator])[0]


def draw_rows(
    weights: torch.Tensor,  # [num_rows, vocab], >= 0, no row all 0
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """`draw` for every row, row i from `generators[i]`, in one pass over the vocabulary: the
    same cumulative weights and the same uniform draws (each generator's in row order, the
    global RNG's for rows without one), so the same tokens as drawing the rows one by one."""
    if len(generators) != weights.shape[0]:
        raise ValueError("draw_rows needs one generator (or None) per row")
    cdf = weights.double().cumsum(-1)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    uniform = torch.empty(len(generators), dtype=torch.float64)
    if unseeded:  # the global RNG draws them in one call, as one by one
        uniform[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            uniform[i] = torch.rand(1, dtype=torch.float64, generator=g, device=g.device).cpu()[0]
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    indices = torch.searchsorted(cdf, target, right=True).squeeze(1).tolist()
    vocab = weights.shape[1]
    for i, index in enumerate(indices):
        if index >= vocab:  # u * total rounded up to the total: the last token with any weight
            indices[i] = int(weights[i].nonzero()[-1])
    return indices


def sample_from_probs(
    probs: torch.Tensor,  # [num_rows, vocab] fp32
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [num_rows] int64
    """One draw per row, each row from its own generator (a request's seed), else the global RNG.

    Greedy rows are one-hot, so the draw returns the argmax without consuming randomness that
    matters to anyone else.
    """
    return torch.tensor(draw_rows(probs, generators), dtype=torch.long)
