"""The paged cache and mixed batches give the same logits as the simple layouts."""

from __future__ import annotations

import pytest
import torch

from tests.factories import scattered_block_ids
from tests.model.helpers import all_logits, make_runner, prefill
from workers.engine.model_runner import SeqForward
from workers.kv_cache import BlockTable

pytestmark = pytest.mark.slow

TEXT = (
    "Speculative decoding lets a small draft propose several tokens that the large model "
    "then checks in a single forward pass, keeping the longest prefix it agrees with."
)


def test_scattered_blocks_give_the_same_logits_as_contiguous(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    ids = checkpoint.tokenizer.encode(TEXT)
    block_size, num_blocks = 4, 64
    runs = []
    for layout in ("contiguous", "scattered"):
        runner, alloc = make_runner(model_fp32, num_blocks, block_size)
        table = BlockTable(alloc, block_size)
        # Hand-place the blocks: 0, 1, 2, ... or a random permutation across the cache.
        if layout == "contiguous":
            table.block_ids = alloc.allocate(-(-len(ids) // block_size))
            assert table.block_ids == sorted(table.block_ids)
        else:
            table.block_ids = scattered_block_ids(len(ids), block_size, num_blocks, seed=5)
        # Prefill in uneven chunks (crossing block edges), then decode token by token.
        logits = [prefill(runner, table, ids[:13], chunk=7)]
        for pos in range(13, len(ids)):
            out = runner.forward([SeqForward([ids[pos]], pos, table.block_ids)])
            logits.append(out.output.logits)
        runs.append(torch.cat(logits))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(runs[0], all_logits(model_fp32, ids), rtol=1e-5, atol=1e-4)


def test_mixed_batch_equals_one_by_one(model_fp32, checkpoint) -> None:  # type: ignore[no-untyped-def]
    tok = checkpoint.tokenizer
    texts = [
        "Write a haiku about the sea.",
        "The quick brown fox jumps over the lazy dog.",
        "import numpy as np\nimport torch\n",
        "Paris is the capital of France and",
        "A list of prime numbers: 2, 3, 5, 7, 11,",
    ]
    contexts = [tok.encode(t) for t in texts]
    # Seq 0 brings a prefill chunk (its first 4 tokens are cached), 1-2 one decode token, 3-4 five.
    new_counts = [len(contexts[0]) - 4, 1, 1, 5, 5]
    cached = [ids[: len(ids) - n] for ids, n in zip(contexts, new_counts, strict=True)]

    def step(seq: int, table: BlockTable) -> SeqForward:
        start = len(cached[seq])
        new = contexts[seq][start:]
        table.prepare_write(start, start + len(new))
        return SeqForward(new, start, table.block_ids, num_logits=len(new))

    alone = []
    for seq in range(len(texts)):
        runner, alloc = make_runner(model_fp32)
        table = BlockTable(alloc, runner.block_size)
        prefill(runner, table, cached[seq])
        alone.append(runner.forward([step(seq, table)]).logits_of(0))

    runner, alloc = make_runner(model_fp32)
    tables = [BlockTable(alloc, runner.block_size) for _ in texts]
    for seq, table in enumerate(tables):
        prefill(runner, table, cached[seq])
    batched = runner.forward([step(seq, tables[seq]) for seq in range(len(texts))])
    for seq in range(len(texts)):
        torch.testing.assert_close(batched.logits_of(seq), alone[seq], rtol=1e-5, atol=1e-4)
