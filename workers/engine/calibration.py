"""What a forward costs on this machine, measured at start-up for adaptive speculation.

Verifying k drafts is one forward over k + 1 tokens. How that compares with a one-token forward
depends on the hardware: on a CPU in bf16, one row takes a GEMV path and two rows already a GEMM
(+25% here), after which more rows are nearly free; on a GPU the curve stays flat far longer.
So the engine measures it instead of assuming it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kernels.tree_attention import tree_of
from workers.engine.config import SpecConfig
from workers.engine.graph_runner import GraphRunner
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.transformer import TransformerLM

if TYPE_CHECKING:
    from workers.drafting.base import Drafter


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
    return runner_samples(runner, table.block_ids, counts, reps, context)


def runner_samples(
    runner: ModelRunner,
    block_ids: Sequence[int],
    counts: Sequence[int],
    reps: int,
    context: int = 128,
    width: int | None = None,
) -> list[list[float]]:
    """`forward_samples` through `runner`, over blocks it may write (`block_ids`, room for
    `context` + max(counts) tokens). With `width`, n new tokens come as sequences of at most
    `width` tokens each over the same context, as a step verifying drafts of width - 1 tokens
    brings them (a graph runner replays its graphs for those); else as one sequence."""
    vocab = runner.model.config.vocab_size
    runner.forward([SeqForward([(i * 7919) % vocab for i in range(context)], 0, block_ids)])
    batches = []
    for n in counts:
        tokens = [(context + i) % vocab for i in range(n)]
        size = width or n
        chunks = [tokens[s : s + size] for s in range(0, n, size)]
        batches.append([SeqForward(c, context, block_ids, num_logits=len(c)) for c in chunks])
    return _timed(runner, batches, reps)


def calibration_counts(max_tokens: int) -> list[int]:
    """The forward sizes calibration times: 1, 2, 4, 8, ... and max_tokens."""
    return sorted(
        {1, max_tokens} | {2**i for i in range(max_tokens.bit_length()) if 2**i < max_tokens}
    )


@torch.inference_mode()
def verify_costs(model: TransformerLM, max_tokens: int, reps: int = 5) -> tuple[float, ...]:
    """Cost of a forward over n = 1..max_tokens new tokens in one-token forwards (entry n - 1):
    verifying k drafts of one sequence is n = k + 1, a batch's step the sum over its sequences.
    Measured at 1, 2, 4, 8, ... and max_tokens, linear in between. Each count's cost is the
    median over rounds of its time over the one-token forward's in the same round: on a busy
    machine the absolute times of separate medians can disagree by half (seen on 2 cores)."""
    counts = calibration_counts(max_tokens)
    return costs_from_samples(counts, forward_samples(model, counts, reps), max_tokens)


def costs_from_samples(
    counts: Sequence[int], samples: Sequence[Sequence[float]], max_tokens: int
) -> tuple[float, ...]:
    """`verify_costs`' table from the timings of `counts` (one list per count, by round)."""
    by_count = dict(zip(counts, samples, strict=True))
    ratio = {
        n: statistics.median(t / one for t, one in zip(by_count[n], by_count[1], strict=True))
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


@dataclass(frozen=True, slots=True)
class DraftCosts:
    """Per method, in one-token target forwards: a drafted token, each further sequence's share
    of a depth, a drafting call's fixed part (workers/engine/speculator.py prices them), and a
    draft tree's proposal (workers/engine/tree_pricing.py)."""

    tokens: dict[str, float]
    rows: dict[str, float] = field(default_factory=dict)
    launches: dict[str, float] = field(default_factory=dict)
    trees: dict[str, float] = field(default_factory=dict)  # a tree proposal, one sequence


def draft_costs_in_forwards(
    given: DraftCosts,
    drafters: Mapping[str, Drafter],
    draft_seconds: Mapping[str, float],
    one_token_seconds: float,
) -> DraftCosts:
    """`given` with each drafter's measured seconds (a token's, `draft_seconds`; a further
    row's and a launch's, where the drafter measured them) divided by a one-token forward."""
    one = one_token_seconds
    measured = [(m, d) for m, d in drafters.items() if m in draft_seconds]
    return DraftCosts(
        given.tokens | {m: s / one for m, s in draft_seconds.items()},
        {m: d.row_seconds / one for m, d in measured if d.row_seconds is not None},
        {m: d.launch_seconds / one for m, d in measured if d.launch_seconds is not None},
        {m: d.tree_seconds / one for m, d in measured if d.tree_seconds is not None},
    )


def engine_samples(
    runner: ModelRunner,
    allocator: BlockAllocator,
    counts: list[int],
    width: int | None = None,
    context: int = 128,
) -> list[list[float]]:
    """`runner_samples` through an engine's runner, on blocks lent by its allocator."""
    needed = -(-(context + max(counts)) // runner.block_size)
    blocks = allocator.allocate(needed)
    try:
        return runner_samples(runner, blocks, counts, 5, context, width)
    finally:
        allocator.free(blocks)


def runner_one_token_seconds(runner: ModelRunner, allocator: BlockAllocator) -> float:
    """Median seconds of a one-token forward through an engine's runner (graphs included)."""
    return statistics.median(engine_samples(runner, allocator, [1])[0])


def step_verify_costs(
    runner: ModelRunner, allocator: BlockAllocator, spec: SpecConfig, has_drafters: bool
) -> tuple[float, ...]:
    """What verifying costs the engine's steps (`verify_costs`' curve), measured where steps
    run: a graph runner's graphs, with a step's tokens as sequences verifying k drafts each."""
    if spec.verify_costs is not None:
        return spec.verify_costs
    if not (spec.adaptive and has_drafters):
        return (1.0,)  # k is not chosen by cost: nothing to measure
    # A step's forward holds every decoding sequence's token and drafts; speculation stops at
    # disable_batch_size sequences.
    per_seq = max(spec.num_speculative_tokens, 1) + 1
    max_tokens = min(max(spec.disable_batch_size - 1, 1) * per_seq, 256)
    max_tokens = max(max_tokens, spec.tree_nodes + 1)  # a lone sequence's draft tree
    if not isinstance(runner, GraphRunner):
        return verify_costs(runner.model, max_tokens)
    counts = calibration_counts(max_tokens)
    return costs_from_samples(
        counts, engine_samples(runner, allocator, counts, per_seq), max_tokens
    )


# A tree is drafted mid-answer, over a prompt and the answer so far: its steps are timed over a
# context of a quarter of the served length (at most 1,024 tokens), not the chain curve's 128.
TREE_CONTEXT_SHARE, MAX_TREE_CONTEXT = 4, 1024
TREE_BRANCH = 4  # the timed trees' fan-out (the cost depends on the width, hardly the shape)


@dataclass(frozen=True, slots=True)
class TreeStepCosts:
    """What a step with a draft tree costs as served, in one-token forwards over the same
    context: by (sequences in the step, the tree's width: its nodes and root). On a graph
    runner every sequence of such a step is padded to the tree's captured width and the step
    replays one wide graph through the masked kernel, so the table is measured, not read off
    the chain curve (workers/engine/tree_pricing.py uses it)."""

    context: int  # the cached tokens under the timed steps
    sizes: tuple[int, ...]  # sequences a step held
    widths: tuple[int, ...]  # tree widths
    costs: dict[tuple[int, int], float]  # (sequences, width) -> one-token forwards

    def cost(self, num_seqs: int, width: int) -> float:
        """A step of `num_seqs` sequences with a tree of `width` (rounded up to what was timed;
        past the largest, in proportion)."""
        b = next((s for s in self.sizes if s >= num_seqs), self.sizes[-1])
        w = next((x for x in self.widths if x >= width), self.widths[-1])
        scale = max(num_seqs / b, 1.0) * max(width / w, 1.0)
        return self.costs[(b, w)] * scale


def tree_step_costs(
    runner: ModelRunner,
    allocator: BlockAllocator,
    widths: Sequence[int],
    sizes: Sequence[int],
    max_model_len: int,
    reps: int = 3,
) -> TreeStepCosts | None:
    """Steps of each size in `sizes` whose sequences each verify a tree of each width in
    `widths`, timed through the engine's runner (a graph runner replays its tree graphs) over
    a context the served length gives, against a one-token forward over the same context;
    None where the cache cannot lend the blocks."""
    if not widths or not sizes:
        return None
    block = runner.block_size
    context = min(max_model_len // TREE_CONTEXT_SHARE, MAX_TREE_CONTEXT)
    per_seq = -(-(context + max(widths)) // block)
    if per_seq * max(sizes) > allocator.num_free_blocks or context < 1:
        return None
    tables = [allocator.allocate(per_seq) for _ in range(max(sizes))]
    try:
        vocab = runner.model.config.vocab_size
        prompt = [(i * 7919) % vocab for i in range(context)]
        runner.forward([SeqForward(prompt, 0, t) for t in tables])
        shapes = [(b, w) for b in sizes for w in widths]
        steps = [[_tree_forward(context, w, tables[i], vocab) for i in range(b)] for b, w in shapes]
        one = [SeqForward([1], context, tables[0])]
        samples = _timed(runner, [one, *steps], reps)
    finally:
        for t in tables:
            allocator.free(t)
    costs = {
        shape: statistics.median(t / o for t, o in zip(times, samples[0], strict=True))
        for shape, times in zip(shapes, samples[1:], strict=True)
    }
    return TreeStepCosts(context, tuple(sorted(sizes)), tuple(sorted(widths)), costs)


def _tree_forward(context: int, width: int, block_ids: Sequence[int], vocab: int) -> SeqForward:
    """A sequence verifying a tree of `width` tokens (its last token and width - 1 nodes)."""
    parents = [-1 if i < TREE_BRANCH else i // TREE_BRANCH - 1 for i in range(width - 1)]
    tokens = [(context + i) % vocab for i in range(width)]
    return SeqForward(tokens, context, block_ids, width, tree=tree_of(context, parents))


def _timed(
    runner: ModelRunner, batches: Sequence[list[SeqForward]], reps: int
) -> list[list[float]]:
    """Seconds of each batch's forward, `reps` rounds over all of them (a warm-up dropped)."""
    device = runner.model.device
    samples: list[list[float]] = [[] for _ in batches]
    for _ in range(reps + 1):
        for seqs, times in zip(batches, samples, strict=True):
            start = time.perf_counter()
            runner.forward(seqs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return [t[1:] for t in samples]
