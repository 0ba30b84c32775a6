"""Tensor-parallel slices of a model, summed over a real gloo group (threads here, actors in
tests/cluster), give the whole model's logits; uneven head splits included."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster.links import TensorLink
from kernels.rotary import RopeScaling
from tests.factories import random_hf_weights, tiny_config
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.loader import Checkpoint
from workers.model.tensor_parallel import (
    build_sharded_model,
    emulate_row_parallel,
    shard_config,
    split_evenly,
)


def test_split_evenly() -> None:
    assert split_evenly(3, 2) == [range(0, 2), range(2, 3)]
    assert split_evenly(1536, 2) == [range(0, 768), range(768, 1536)]
    with pytest.raises(ValueError):
        split_evenly(1, 2)


def group(world: int) -> list[TensorLink]:
    host = TensorLink.host(f"tp-{world}-{threading.get_ident()}", world=world, timeout_s=20)
    links: dict[int, TensorLink] = {0: host}
    threads = [
        threading.Thread(
            target=lambda r=r: links.setdefault(r, TensorLink.join(host.address, 20, r))
        )
        for r in range(1, world)
    ]
    for t in threads:
        t.start()
    host.connect()
    for t in threads:
        t.join()
    return [links[r] for r in range(world)]


@pytest.mark.parametrize(
    ("arch", "kv_heads", "world"),
    [("qwen2", 2, 2), ("qwen2", 3, 2), ("qwen2", 4, 4), ("qwen3", 3, 2), ("llama", 2, 2)],
)
def test_sharded_forward_matches_the_whole_model(arch: str, kv_heads: int, world: int) -> None:
    """Qwen3's per-head norms are replicated on every rank; llama's rope scaling too."""
    scaling = (
        RopeScaling("llama3", factor=8.0, original_max_positions=4) if arch == "llama" else None
    )
    config = tiny_config(
        num_heads=2 * kv_heads, num_kv_heads=kv_heads, architecture=arch, rope_scaling=scaling
    )
    checkpoint = Checkpoint(config, random_hf_weights(config, seed=1), tokenizer=None)  # type: ignore[arg-type]
    whole = build_sharded_model(checkpoint, 0, 1, None)
    seqs = [
        SeqForward([5, 9, 11, 3, 7], 0, [0, 1], num_logits=5),
        SeqForward([4, 8], 0, [2], num_logits=2),
    ]

    def run(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
        cache = PagedKVCache(model.config, 4, 4, torch.float32)
        runner = ModelRunner(model, cache)
        runner.forward(seqs)  # prefill
        step = [SeqForward([13, 2], 5, [0, 1], num_logits=2), SeqForward([6], 2, [2])]
        return runner.forward(step).output.logits

    want = run(whole)
    links = group(world)
    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        model = build_sharded_model(checkpoint, r, world, links[r].all_reduce)
        assert model.config == shard_config(config, r, world)
        results[r] = run(model)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(world):
        torch.testing.assert_close(results[r], want, rtol=1e-5, atol=1e-5)


def test_rank_zero_sends_plans_and_raises_a_rank_failure() -> None:
    """Rank 0's runner sends each forward's plan (copies, sequences without logits) over the
    step channels before its own forward, and a rank's failure surfaces at a later forward."""
    from cluster.actors import RankFailed, StepPlan, TensorParallelRunner
    from cluster.step_channel import StepClient, StepServer

    config = tiny_config()
    checkpoint = Checkpoint(config, random_hf_weights(config, seed=2), tokenizer=None)  # type: ignore[arg-type]
    model = build_sharded_model(checkpoint, 0, 1, None)
    plans: list[StepPlan] = []

    def rank(plan: StepPlan) -> None:
        plans.append(plan)
        if len(plans) == 2:
            raise ValueError("out of memory, say")

    server = StepServer(rank)
    runner = TensorParallelRunner(
        ModelRunner(model, PagedKVCache(model.config, 4, 4, torch.float32)),
        [StepClient(server.address())],
    )
    try:
        runner.copy_blocks([(0, 1)])
        runner.forward([SeqForward([5, 9, 11], 0, [2], num_logits=3)])
        runner.forward([SeqForward([4], 3, [2], num_logits=1)])
        deadline = time.monotonic() + 5
        while len(plans) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the failure's reply
        with pytest.raises(RankFailed, match="out of memory"):
            runner.forward([SeqForward([7], 4, [2, 3], num_logits=1)])
        assert plans[0].block_copies == [(0, 1)] and plans[1].block_copies == []
        assert [s.token_ids for p in plans for s in p.seqs] == [[5, 9, 11], [4]]
        assert all(s.num_logits == 0 for p in plans for s in p.seqs)
    finally:
        server.close()


def test_a_remote_prefill_lands_on_every_rank_of_the_group() -> None:
    """Rank 0 receives the whole model's K/V of a prompt (every head), keeps its heads and sends
    the other rank its own with the next plan; the next forward matches the whole model's as if
    the group had computed the prompt itself (3 KV heads split 2 + 1, slots in reused blocks)."""
    from cluster.actors import TensorParallelRunner, replay
    from cluster.step_channel import StepClient, StepServer

    config = tiny_config(num_heads=6, num_kv_heads=3, architecture="qwen2")
    checkpoint = Checkpoint(config, random_hf_weights(config, seed=3), tokenizer=None)  # type: ignore[arg-type]
    prompt, block_size = [5, 9, 11, 3, 7, 2], 4
    whole = ModelRunner(
        build_sharded_model(checkpoint, 0, 1, None),
        PagedKVCache(config, 4, block_size, torch.float32),
    )
    whole.forward([SeqForward(prompt, 0, [0, 1])])
    kv = whole.kv_cache.read_slots(torch.arange(len(prompt)))  # what a prefill worker sends
    want = whole.forward([SeqForward([13], len(prompt), [0, 1], num_logits=1)]).output.logits

    links = group(2)
    ranks = [build_sharded_model(checkpoint, r, 2, links[r].all_reduce) for r in range(2)]
    runners = [ModelRunner(m, PagedKVCache(m.config, 4, block_size, torch.float32)) for m in ranks]
    server = StepServer(lambda plan: replay(runners[1], links[1], plan))
    runner = TensorParallelRunner(
        runners[0], [StepClient(server.address())], links[0], split_evenly(3, 2)
    )
    try:
        blocks = [3, 1]  # other blocks than the whole model's: slots are what the plan carries
        slots = torch.tensor(
            [blocks[i // block_size] * block_size + i % block_size for i in range(6)]
        )
        runner.write_prefilled(slots, kv)
        got = runner.forward([SeqForward([13], len(prompt), blocks, num_logits=1)]).output.logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # Each rank's cache holds its own heads of the prompt: rank 0 heads 0-1, rank 1 head 2.
        torch.testing.assert_close(runners[0].kv_cache.read_slots(slots), kv[:, :, :, :2])
        torch.testing.assert_close(runners[1].kv_cache.read_slots(slots), kv[:, :, :, 2:])
        with pytest.raises(ValueError, match="K/V of 2 heads"):
            runner.write_prefilled(slots, kv[:, :, :, :2])
    finally:
        server.close()


def group_forward(checkpoint: Checkpoint, world: int, dtype: torch.dtype, seqs, step):  # type: ignore[no-untyped-def]
    """Logits of `step` after `seqs` from a real group of `world` ranks (threads, gloo), and
    each rank's K/V cache."""
    links = group(world)
    results: dict[int, tuple[torch.Tensor, PagedKVCache]] = {}

    def rank(r: int) -> None:
        model = build_sharded_model(checkpoint, r, world, links[r].all_reduce, dtype)
        cache = PagedKVCache(model.config, 4, 4, dtype)
        runner = ModelRunner(model, cache)
        runner.forward(seqs)
        results[r] = (runner.forward(step).output.logits, cache)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 3])
def test_one_process_emulating_a_group_computes_its_bits(dtype: torch.dtype, kv_heads: int) -> None:
    """`emulate_row_parallel`: the whole model in one process, its row-parallel projections
    summed rank by rank, gives a group of two ranks' logits and K/V bit for bit (what a prefill
    worker must hand a tensor-parallel verifier group); the plain whole model does not. Larger
    groups are refused. Heads of 32 dimensions: our attention kernel's (SDPA's bits depend on
    how many heads a call holds)."""
    from kernels.linear import row_independent_rows

    if row_independent_rows(dtype) < 64:
        pytest.skip("needs our native kernels for every row")
    world = 2
    config = tiny_config(
        num_heads=2 * kv_heads, num_kv_heads=kv_heads, intermediate_size=64, head_dim=32
    )
    checkpoint = Checkpoint(config, random_hf_weights(config, seed=4), tokenizer=None)  # type: ignore[arg-type]
    seqs = [SeqForward([5, 9, 11, 3, 7, 1, 8], 0, [0, 1], num_logits=7)]
    step = [SeqForward([13, 2], 7, [0, 1, 2], num_logits=2)]
    ranks = group_forward(checkpoint, world, dtype, seqs, step)
    model = build_sharded_model(checkpoint, 0, 1, None, dtype)
    got = {}
    for emulated in (False, True):
        emulate_row_parallel(model, world if emulated else 1)
        cache = PagedKVCache(config, 4, 4, dtype)
        runner = ModelRunner(model, cache)
        runner.forward(seqs)
        got[emulated] = (runner.forward(step).output.logits, cache)
    logits, cache = got[True]
    heads = split_evenly(kv_heads, world)
    slots = torch.arange(9)
    for r, (rank_logits, rank_cache) in ranks.items():
        assert torch.equal(logits, rank_logits), r
        kv = cache.read_slots(slots)[:, :, :, heads[r].start : heads[r].stop]
        assert torch.equal(kv, rank_cache.read_slots(slots)), r
    assert not torch.equal(got[False][0], ranks[0][0])  # one sum per output is other bits
    with pytest.raises(ValueError, match="4 ranks cannot be emulated"):
        emulate_row_parallel(model, 4)
