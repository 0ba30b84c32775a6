"""The graph runner's padded path on the CPU: everything a CUDA graph replays except the capture.

Decode and verify steps run on persistent buffers, padded to a captured batch size and to the
widest draft, attending through the uniform-batch backend. Greedy output must equal plain
decoding for every drafter, and padding must leave no trace: not in outputs, not in the
speculation counters, not in any block a sequence owns."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_uniform import UniformTorchAttention
from kernels.tree_attention import tree_of
from tests.factories import tiny_model
from tests.model.helpers import run_staggered
from tests.unit.test_cuda import GREEDY, METHODS, SPEC, make_drafter, prompts, spec_for
from workers.drafting.base import Drafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.graph_runner import GraphRunner, capture_sizes, make_runner, tree_widths
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sequential import SequentialEngine
from workers.engine.step_buffers import StepBuffers, UniformShape
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM

MAX_NUM_SEQS = 16
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=4, max_position_embeddings=512)


def config(spec: SpecConfig = SPEC) -> EngineConfig:
    return EngineConfig(
        max_model_len=512, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, spec=spec
    )


def padded_runner(
    model: TransformerLM, drafter: Drafter | None, spec: SpecConfig = SPEC
) -> GraphRunner:
    """The graph runner's padded path (with the tree widths `spec`'s trees need)."""
    blocks = config().kv_blocks
    cache = PagedKVCache(model.config, blocks + 1, BLOCK_SIZE, model.dtype, model.device)
    width = 1 + spec.num_speculative_tokens
    return GraphRunner(
        model,
        cache,
        attention=UniformTorchAttention(),
        max_num_seqs=MAX_NUM_SEQS,
        max_width=width,
        max_graph_tokens=512,
        scratch_block=blocks,
        hidden_layers=() if drafter is None else drafter.hidden_layers,
        tree_widths=tree_widths(spec.tree_nodes, width),
        max_tree_seqs=MAX_NUM_SEQS,
    )


def engine(model: TransformerLM, method: str, padded: bool) -> LLMEngine:
    drafter = make_drafter(method, model)
    spec = spec_for(method)
    runner = padded_runner(model, drafter, spec) if padded else None
    return LLMEngine(model, config(spec), drafters={drafter.method: drafter}, runner=runner)


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("method", METHODS)
def test_padded_steps_give_plain_decodings_greedy_output(
    model: TransformerLM, method: str, batch: int
) -> None:
    prompt_ids = prompts(batch, seed=batch)
    plain = SequentialEngine(model, max_model_len=512)
    expected = [plain.generate(p, GREEDY).token_ids for p in prompt_ids]
    eng = engine(model, method, padded=True)
    (drafted_by,) = eng.speculator.drafters
    got = run_staggered(eng, prompt_ids, GREEDY, RequestSpec(method=drafted_by))
    assert got == expected
    assert isinstance(eng.runner, GraphRunner)
    assert eng.runner.num_padded_steps > 0  # the padded path ran (no graphs on a CPU)
    assert eng.stats.drafted > 0
    assert eng.allocator.num_free_blocks == eng.config.kv_blocks


def test_padding_leaves_no_trace_in_outputs_stats_or_cache(model: TransformerLM) -> None:
    """Against the eager engine, step by step: the same tokens, the same counters, and the same
    K/V in every block a sequence owns (a padded token writing into one would show)."""
    prompt_ids = prompts(5, seed=3)  # 5 sequences: padded to a batch of 8
    eager, padded = (engine(model, "ngram", padded=p) for p in (False, True))
    spec = RequestSpec(method="ngram")
    for i, p in enumerate(prompt_ids):
        for eng in (eager, padded):
            eng.add_request(f"r{i}", p, GREEDY, spec)
    while eager.has_unfinished_requests():
        a, b = eager.step(), padded.step()
        assert [(o.request_id, o.new_token_ids) for o in a] == [
            (o.request_id, o.new_token_ids) for o in b
        ]
        owned = sorted(
            {block for seq in padded._seqs.values() for block in seq.block_table.block_ids}
        )
        if owned:
            index = torch.tensor(owned)
            torch.testing.assert_close(
                padded.runner.kv_cache.data[:, :, index],
                eager.runner.kv_cache.data[:, :, index],
                rtol=1e-5,
                atol=1e-5,
            )
    assert padded.stats == eager.stats
    assert padded.has_unfinished_requests() is False


def test_a_uniform_shape_is_chosen_only_for_decode_and_verify(model: TransformerLM) -> None:
    runner = padded_runner(model, None)
    blocks = list(range(8))
    decode = SeqForward([5], 10, blocks, num_logits=1)
    verify = SeqForward([5, 6, 7], 10, blocks, num_logits=3)
    assert runner.uniform_shape([decode]) == UniformShape(1, 1)
    assert runner.uniform_shape([decode, verify, decode]) == UniformShape(4, 3)
    prefill = SeqForward(list(range(12)), 0, blocks, num_logits=1)
    assert runner.uniform_shape([decode, prefill]) is None  # a prompt chunk: eager
    too_wide = SeqForward(list(range(6)), 10, blocks, num_logits=6)
    assert runner.uniform_shape([too_wide]) is None
    assert runner.uniform_shape([decode], return_final_hidden=True) is None
    assert runner.uniform_shape([decode], hidden_layers=(0,)) is None  # no graph keeps it
    assert runner.uniform_shape([decode] * (MAX_NUM_SEQS + 1)) is None
    small = GraphRunner(
        runner.model,
        runner.kv_cache,
        attention=UniformTorchAttention(),
        max_num_seqs=MAX_NUM_SEQS,
        max_width=5,
        max_graph_tokens=12,
        scratch_block=runner.kv_cache.num_blocks - 1,
    )
    assert small.uniform_shape([verify] * 3) == UniformShape(4, 3)  # 12 rows fit the budget
    assert small.uniform_shape([verify] * 5) is None  # padded to 8 x 3: past it, eager


def test_a_padded_step_checks_each_sequences_room_as_an_eager_one_does(
    model: TransformerLM,
) -> None:
    runner = padded_runner(model, None)
    short_table = SeqForward([5, 6], 15, [3, 4], num_logits=2)  # position 16 needs a third block
    assert runner.uniform_shape([short_table]) is not None  # the padded path, not eager
    with pytest.raises(ValueError, match="block table holds 2 blocks"):
        runner.forward([short_table])
    with pytest.raises(ValueError, match="past the context"):
        runner.forward([SeqForward([5], 512, list(range(65)), num_logits=1)])


def test_capture_sizes_step_by_16_after_8() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def cpu_buffers(max_width: int, max_blocks: int, max_positions: int) -> StepBuffers:
    """Step buffers for 4 sequences of 4-token blocks on the CPU, scratch slot 99."""
    return StepBuffers(
        max_num_seqs=4,
        max_width=max_width,
        max_blocks=max_blocks,
        block_size=4,
        scratch_slot=99,
        max_positions=max_positions,
        device=torch.device("cpu"),
    )


def test_staged_padding_writes_only_the_scratch_slot() -> None:
    buffers = cpu_buffers(max_width=3, max_blocks=6, max_positions=12)
    seqs = [SeqForward([7, 8, 9], 5, [3, 1], 3), SeqForward([4], 10, [2, 0, 5], 1)]
    buffers.stage(seqs, UniformShape(4, 3))
    t = buffers.views(UniformShape(4, 3))
    assert t.input_ids.view(4, 3).tolist() == [[7, 8, 9], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    # positions 5, 6, 7 live in block 1 (slots 4..7); position 10 in block 5 (slot 22).
    assert t.slot_mapping.view(4, 3).tolist() == [
        [5, 6, 7],
        [22, 99, 99],
        [99, 99, 99],
        [99, 99, 99],
    ]
    assert t.positions.view(4, 3).tolist()[1] == [10, 11, 11]  # clamped into the table
    assert t.seq_lens.tolist() == [8, 13, 3, 3]
    assert t.block_tables[:2, :3].tolist() == [[3, 1, 0], [2, 0, 5]]
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage(seqs, UniformShape(1, 3))


def test_staged_block_tables_follow_their_tables_versions() -> None:
    """A row's block ids are written again only when the sequence's table has another version
    than the row holds: sequences that swap rows, or a table changed at the same length (a
    rolled-back block given back and another taken), get their new ids."""
    from workers.kv_cache import BlockAllocator, BlockTable

    buffers = cpu_buffers(max_width=1, max_blocks=4, max_positions=16)
    allocator = BlockAllocator(12)
    a, b = BlockTable(allocator, 4), BlockTable(allocator, 4)
    a.prepare_write(0, 6)
    b.prepare_write(0, 3)

    def staged(*tables: BlockTable) -> list[list[int]]:
        seqs = [SeqForward([1], 2, t.block_ids, 1, t.version) for t in tables]
        buffers.stage(seqs, UniformShape(4, 1))
        rows = buffers.views(UniformShape(4, 1)).block_tables.tolist()
        return [rows[i][: len(t.block_ids)] for i, t in enumerate(tables)]

    assert staged(a, b) == [a.block_ids, b.block_ids]
    assert staged(b, a) == [b.block_ids, a.block_ids]  # rows swapped
    before = (a.version, list(a.block_ids))
    a.truncate(4)  # its second block rolled back, and another taken: the same length
    allocator.allocate(1)  # so that the freed block is not the one taken back
    a.prepare_write(4, 6)
    assert len(a.block_ids) == 2 and a.block_ids != before[1] and a.version != before[0]
    assert staged(a, b) == [a.block_ids, b.block_ids]
    # An unchanged version is not written again (the row keeps what it holds).
    lie = SeqForward([1], 2, [11, 11], 1, a.version)
    buffers.stage([lie], UniformShape(4, 1))
    assert buffers.views(UniformShape(4, 1)).block_tables[0, :2].tolist() == a.block_ids


def test_the_cpu_gets_the_eager_runner_and_a_gpu_config_can_ask_for_it(
    model: TransformerLM,
) -> None:
    runner = make_runner(model, config())
    assert type(runner) is ModelRunner
    assert runner.kv_cache.num_blocks == config().kv_blocks


TREE_PARENTS = (-1, -1, 0, 0, 1, 2)  # six nodes: two at each of three depths


def test_a_tree_step_takes_the_next_captured_tree_width(model: TransformerLM) -> None:
    runner = padded_runner(model, None, spec_for("eagle_tree"))  # tree widths 9 and 13
    blocks = list(range(8))
    decode = SeqForward([5], 10, blocks, num_logits=1)
    tree = SeqForward([5] * 7, 10, blocks, num_logits=7, tree=tree_of(10, TREE_PARENTS))
    assert runner.uniform_shape([decode, tree]) == UniformShape(2, 9)
    ten = tree_of(10, (-1, *range(9)))
    wide = SeqForward([5] * 11, 10, blocks, num_logits=11, tree=ten)
    assert runner.uniform_shape([wide]) == UniformShape(1, 13)
    assert padded_runner(model, None).uniform_shape([tree]) is None  # no tree widths: eager


def test_a_padded_tree_step_computes_what_the_eager_one_does(model: TransformerLM) -> None:
    """A chain's verify and a tree's in one step, padded to a tree width and attending through
    tail masks, against the eager forward's tree rows (kernels/tree_attention.py)."""
    spec = spec_for("eagle_tree")
    padded = padded_runner(model, None, spec)
    cache = PagedKVCache(model.config, padded.kv_cache.num_blocks, BLOCK_SIZE, model.dtype)
    eager = ModelRunner(model, cache)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (19, 11)]
    tables = [list(range(0, 5)), list(range(5, 10))]
    for runner in (padded, eager):
        runner.forward([SeqForward(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    step = [
        SeqForward([7, 8, 9], 19, tables[0], 3),
        SeqForward([7, *range(20, 26)], 11, tables[1], 7, tree=tree_of(11, TREE_PARENTS)),
    ]
    got, want = padded.forward(step), eager.forward(step)
    assert padded.num_padded_steps == 1
    for i in range(2):
        torch.testing.assert_close(got.logits_of(i), want.logits_of(i), rtol=1e-4, atol=1e-4)
