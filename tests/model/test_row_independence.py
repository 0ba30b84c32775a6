"""A token's logits are the same bits however its forward was made up, on the bundled model with
every dtype and weight format a CPU deployment offers: alone in a decode step, inside a
verification of drafts, beside another sequence, or in a prompt chunk. What speculation's
exactness rests on (a different last bit can flip a near-tie between two tokens), checked
directly rather than through outputs that near-ties rarely reach."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import ROW_PROMPT, assert_logits_independent_of_forward
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT = ROW_PROMPT


def logits_of(runner: ModelRunner, forwards: list[SeqForward]) -> list[torch.Tensor]:
    output = runner.forward(forwards)
    return [output.logits_of(i).clone() for i in range(len(forwards))]


def test_a_tokens_logits_do_not_depend_on_its_forward(cpu_format_model: TransformerLM) -> None:
    assert_logits_independent_of_forward(cpu_format_model, BLOCK)


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
