"""A token's logits are the same bits however its forward was made up, on the bundled model with
every dtype and weight format a CPU deployment offers: alone in a decode step, inside a
verification of drafts, beside another sequence, or in a prompt chunk. What speculation's
exactness rests on (a different last bit can flip a near-tie between two tokens), checked
directly rather than through outputs that near-ties rarely reach."""

from __future__ import annotations

import pytest
import torch

from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = [1, 504, 3458, 314, 253, 4016, 1789, 30, 2, 198, 1, 9690, 198, 4982, 2444, 282, 4536]
NEW = [338, 1085, 3145, 411, 260, 4413]  # fed after the prompt, as decode steps or as drafts


def logits_of(runner: ModelRunner, forwards: list[SeqForward]) -> list[torch.Tensor]:
    output = runner.forward(forwards)
    return [output.logits_of(i).clone() for i in range(len(forwards))]


def test_a_tokens_logits_do_not_depend_on_its_forward(cpu_format_model: TransformerLM) -> None:
    model = cpu_format_model
    cache = PagedKVCache(model.config, 8, BLOCK, model.dtype)
    runner = ModelRunner(model, cache)
    tokens = PROMPT + NEW
    blocks = [0, 1]  # the sequence under test
    other = [4, 5]  # a second sequence sharing some forwards

    def prefill() -> torch.Tensor:  # the whole prompt at once; the last position's row
        (rows,) = logits_of(runner, [SeqForward(PROMPT, 0, blocks, len(PROMPT))])
        return rows

    whole = prefill()
    # Decode steps: one new token a forward.
    stepped = [whole[-1:]]
    for j, token in enumerate(NEW):
        (row,) = logits_of(runner, [SeqForward([token], len(PROMPT) + j, blocks)])
        stepped.append(row)
    # A verification: every new token in one forward, beside another sequence's prompt.
    prefill()
    verified, _ = logits_of(
        runner,
        [
            SeqForward(NEW, len(PROMPT), blocks, len(NEW)),
            SeqForward(tokens[::-1][:20], 0, other, 3),
        ],
    )
    # The prompt in two chunks, then the new tokens: every position scored.
    (first,) = logits_of(runner, [SeqForward(tokens[:7], 0, blocks, 7)])
    (rest,) = logits_of(runner, [SeqForward(tokens[7:], 7, blocks, len(tokens) - 7)])
    chunked = torch.cat([first, rest])
    assert torch.equal(whole, chunked[: len(PROMPT)])
    for j in range(len(NEW)):  # row j scores the position after NEW[j]
        assert torch.equal(stepped[j + 1][0], verified[j]), j
        assert torch.equal(stepped[j + 1][0], chunked[len(PROMPT) + j]), j


@pytest.mark.parametrize("fmt", ["bf16-blocks", "fp32"])
def test_a_prefill_worker_computes_what_a_group_of_two_ranks_does(
    fmt: str,
    checkpoint,
    quantized_checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    """The bundled model as a prefill worker serving verifier groups of two tensor-parallel
    ranks builds it (`emulate_row_parallel`): a prompt's K/V and its logits are the group's
    own bits, so a prompt prefilled remotely continues as one prefilled by the group."""
    import threading

    from kernels.linear import row_independent_rows
    from tests.conftest import CPU_FORMATS
    from tests.unit.test_tensor_parallel import group
    from workers.model.loader import build_model
    from workers.model.tensor_parallel import (
        build_sharded_model,
        emulate_row_parallel,
        split_evenly,
    )

    dtype, quantization = CPU_FORMATS[fmt]
    if row_independent_rows(dtype) < 64:
        pytest.skip("needs our native kernels for every row")
    source = checkpoint if quantization == "none" else quantized_checkpoint
    forward = [SeqForward(PROMPT, 0, [0, 1], len(PROMPT))]
    slots = torch.arange(len(PROMPT))
    links = group(2)
    ranks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rank(r: int) -> None:
        model = build_sharded_model(source, r, 2, links[r].all_reduce, dtype)
        cache = PagedKVCache(model.config, 2, BLOCK, dtype)
        (rows,) = logits_of(ModelRunner(model, cache), forward)
        ranks[r] = rows, cache.read_slots(slots)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker = build_model(source, dtype=dtype)
    emulate_row_parallel(worker, 2)
    cache = PagedKVCache(worker.config, 2, BLOCK, dtype)
    (rows,) = logits_of(ModelRunner(worker, cache), forward)
    kv = cache.read_slots(slots)
    heads = split_evenly(worker.config.num_kv_heads, 2)
    for r, (rank_rows, rank_kv) in ranks.items():
        assert torch.equal(rows, rank_rows), r
        assert torch.equal(kv[..., heads[r].start : heads[r].stop, :], rank_kv), r
