"""A decoder layer in one native call (workers/model/native_layers.py, kernels/csrc/
decoder_layer.c) against the same layer's six kernels called from Python: the same bits."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from workers.engine.model_runner import ModelRunner, RunnerOutput, SeqForward
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.loader import build_model
from workers.model.transformer import TransformerLM

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

BLOCK = 16
HIDDEN_LAYERS = (0, 7, 29)


def _steps(model: TransformerLM, prompts: list[list[int]]) -> tuple[list[RunnerOutput], bytes]:
    """A prefill chunk beside a decode, then a two-token verify beside a decode, scoring every
    new token, with hidden states of three layers; and the KV cache they left."""
    cache = PagedKVCache(model.config, 16, BLOCK, model.dtype, model.device)
    allocator = BlockAllocator(16)
    tables = [BlockTable(allocator, BLOCK) for _ in prompts]
    for table, prompt in zip(tables, prompts, strict=True):
        table.prepare_write(0, len(prompt))
    runner = ModelRunner(model, cache)
    a, b = prompts
    outputs = [
        runner.forward([SeqForward(a[:-3], 0, tables[0].block_ids)]),
        runner.forward([SeqForward(b[:-1], 0, tables[1].block_ids)]),
        runner.forward(
            [
                SeqForward(a[-3:-2], len(a) - 3, tables[0].block_ids),
                SeqForward(b[-1:], len(b) - 1, tables[1].block_ids),
            ],
            hidden_layers=HIDDEN_LAYERS,
        ),
        runner.forward(
            [
                SeqForward(a[-2:], len(a) - 2, tables[0].block_ids, 2),
                SeqForward([b[0]], len(b), tables[1].block_ids),
            ],
            hidden_layers=HIDDEN_LAYERS,
        ),
    ]
    return outputs, cache.data.view(torch.int16).numpy().tobytes()


def _in_python(model: TransformerLM) -> None:
    model.layers_changed()
    model._native_layers, model._native_checked = None, True


@pytest.fixture(scope="module")
def bf16_blocks(quantized_checkpoint):  # type: ignore[no-untyped-def]
    return build_model(quantized_checkpoint, dtype=torch.bfloat16)


def _compare(model: TransformerLM, prompts: list[list[int]]) -> None:
    model.layers_changed()
    with torch.inference_mode():
        assert model._native() is not None
        ours, our_cache = _steps(model, prompts)
        _in_python(model)
        theirs, their_cache = _steps(model, prompts)
    model.layers_changed()
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.output.logits, reference.output.logits)
        assert mine.output.hidden_states.keys() == reference.output.hidden_states.keys()
        for layer, hidden in mine.output.hidden_states.items():
            assert torch.equal(hidden, reference.output.hidden_states[layer])
    assert our_cache == their_cache


def test_the_layers_in_one_call_each_give_the_bits_of_their_kernels(
    bf16_blocks: TransformerLM,
    quantized_checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    tokenizer = quantized_checkpoint.tokenizer
    prompts = [
        tokenizer.encode("The capital of France is Paris. The capital of Italy is"),
        tokenizer.encode("Write a haiku about the sea, and then one about the mountains:"),
    ]
    _compare(bf16_blocks, prompts)


def test_a_biased_projection_is_added_as_the_python_layers_add_it(
    quantized_checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    """Qwen2's Q/K/V projections carry biases."""
    model = build_model(quantized_checkpoint, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for layer in model.layers:
        proj = layer.self_attn.qkv_proj
        bias = torch.randn(proj.weight.shape[0], generator=generator) * 0.05
        proj.bias = torch.nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
    tokenizer = quantized_checkpoint.tokenizer
    prompts = [tokenizer.encode("One, two, three, four, five"), tokenizer.encode("Hello there")]
    _compare(model, prompts)


def test_layers_the_call_cannot_compute_stay_in_python(
    bf16_blocks: TransformerLM,
    checkpoint,  # type: ignore[no-untyped-def]
) -> None:
    from workers.model.tensor_parallel import emulate_row_parallel

    assert build_model(checkpoint, dtype=torch.float32)._native() is None  # fp32 rows
    assert build_model(checkpoint, dtype=torch.bfloat16)._native() is None  # float weights
    assert bf16_blocks._native() is not None
    emulate_row_parallel(bf16_blocks, 2)  # a tensor-parallel group's sums, emulated
    try:
        assert bf16_blocks._native() is None
    finally:
        emulate_row_parallel(bf16_blocks, 1)
    assert bf16_blocks._native() is not None


@pytest.mark.parametrize("one_call", [True, False])
def test_a_slot_outside_the_cache_is_refused_by_either_path(
    bf16_blocks: TransformerLM,
    one_call: bool,
) -> None:
    cache = PagedKVCache(bf16_blocks.config, 2, BLOCK, bf16_blocks.dtype, bf16_blocks.device)
    runner = ModelRunner(bf16_blocks, cache)
    bf16_blocks.layers_changed()
    if not one_call:
        _in_python(bf16_blocks)
    try:
        why = "a position or a slot" if one_call else "a slot is outside the KV cache"
        with torch.inference_mode(), pytest.raises(IndexError, match=why):
            runner.forward([SeqForward([1, 2, 3], 0, [5])])  # block 5 of a 2-block cache
    finally:
        bf16_blocks.layers_changed()
