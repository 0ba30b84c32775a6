"""`--deterministic` on a GPU: the batch-invariant projection and attention kernels, and the
model and engine that take them.

On the CPU the kernels run under Triton's interpreter, in a subprocess, with its `tl.dot`
computing each row alone (tests/unit/helpers.py `ROW_WISE_DOT`). There the
tests check what the kernels' code decides: the tiles, the order of each sum, which key tiles a
query walks. `pytest -m cuda` checks them compiled, where the hardware's arithmetic counts, and
an engine's greedy text alone, in a batch, after a prefix-cache hit and with speculation."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata
from kernels.attention_invariant import InvariantAttention, tile_rows
from tests.factories import tiny_model
from tests.model.helpers import assert_logits_independent_of_forward
from tests.unit.helpers import run_interpreted
from tests.unit.test_attention import build_case, expected_output
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.kv_cache import PagedKVCache
from workers.model.transformer import TransformerLM, make_deterministic

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def check_projections(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """`batch_invariant.linear` against fp64, each row the same bits in any batch."""
    from kernels import batch_invariant

    gen = torch.Generator().manual_seed(0)
    for bias in (True, False):
        w = torch.randn(200, 150, generator=gen).to(device, dtype)  # outputs past a tile
        b = torch.randn(200, generator=gen).to(device, dtype) if bias else None
        x = torch.randn(70, 150, generator=gen).to(device, dtype)
        whole = batch_invariant.linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(whole.double(), want, rtol=tolerance, atol=tolerance)
        for rows in ([0], [69], slice(3, 40), slice(33, 70), slice(31, 33)):
            assert torch.equal(batch_invariant.linear(x[rows], w, b), whole[rows]), rows
    assert batch_invariant.linear(x[:0], w).shape == (0, 200)


def check_attention(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """`InvariantAttention` against the reference, a query's row the same bits in a whole
    prompt's prefill, a chunk after a cached prefix, a decode step, beside other sequences and
    in a graph's uniform verify step."""
    lens = [150, 70]  # two whole prompts, prefilled in one forward
    query, key_cache, value_cache, meta, contexts, _ = build_case(lens, lens, 16, dtype)
    want = expected_output(query, meta, contexts, 0.25)
    query, key_cache, value_cache = (t.to(device) for t in (query, key_cache, value_cache))
    queries = [query[:150], query[150:]]

    def run(picks: list[tuple[int, int, int]], uniform: bool = False) -> torch.Tensor:
        """`picks`: (sequence, its first new row, its context length) each."""
        q_lens = [s - a for _, a, s in picks]
        view = AttentionMetadata(
            block_size=meta.block_size,
            query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)]).int().to(device),
            seq_lens=torch.tensor([s for _, _, s in picks], dtype=torch.int32, device=device),
            block_tables=meta.block_tables[[i for i, _, _ in picks]].to(device),
            slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
            query_lens_host=tuple(q_lens),
            seq_lens_host=tuple(s for _, _, s in picks),
        )
        backend = InvariantAttention(uniform)
        q = torch.cat([queries[i][a:s] for i, a, s in picks])
        return backend.forward(q, key_cache, value_cache, backend.prepare(view), 0.25)

    whole = run([(0, 0, 150), (1, 0, 70)])
    torch.testing.assert_close(whole.cpu().float(), want.float(), rtol=tolerance, atol=tolerance)
    for first in (1, 20, 63, 64, 65, 149):  # a chunk after a cached prefix
        assert torch.equal(run([(0, first, 150)]), whole[first:150]), first
    assert torch.equal(run([(0, 99, 100)]), whole[99:100])  # a decode step
    mixed = run([(1, 30, 70), (0, 99, 100)])  # a chunk beside a decode
    assert torch.equal(mixed[:40], whole[180:220]) and torch.equal(mixed[40:], whole[99:100])
    verify = run([(0, 95, 100), (1, 60, 65)], uniform=True)  # a graph's verify step
    assert torch.equal(verify[:5], whole[95:100]) and torch.equal(verify[5:], whole[210:215])


def check_model(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """A tiny model on the kernels: its logits the same bits however a forward is made up,
    and its plain forward's within rounding (qwen2: projections with a bias)."""
    for architecture in ("llama", "qwen2"):
        shape = {"architecture": architecture, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16}
        plain = tiny_model(3, **shape).to(device, dtype)
        model = tiny_model(3, **shape).to(device, dtype)
        model.use_batch_invariant_kernels()
        assert isinstance(model.attention, InvariantAttention)
        assert_logits_independent_of_forward(model)

        def logits(m: TransformerLM) -> torch.Tensor:
            runner = ModelRunner(m, PagedKVCache(m.config, 4, 8, m.dtype, m.device))
            return runner.forward([SeqForward([5, 17, 3, 88, 41, 9], 0, [0, 1], 6)]).logits_of(0)

        torch.testing.assert_close(logits(model), logits(plain), rtol=tolerance, atol=tolerance)


INTERPRETED = {
    "projections": "check_projections('cpu', torch.float32, 3e-5)\n"
    "check_projections('cpu', torch.float16, 2e-2)",
    "attention": "check_attention('cpu', torch.float32, 1e-5)\n"
    "check_attention('cpu', torch.float16, 2e-3)",
    "model": "check_model('cpu', torch.float32, 1e-4)",
}


@needs_triton
@pytest.mark.parametrize("part", list(INTERPRETED))
def test_the_kernels_interpreted(part: str) -> None:
    imports = "import torch\nfrom tests.unit.test_batch_invariant import *\n"
    run_interpreted(imports + INTERPRETED[part] + "\nprint('ok')\n", row_wise_dot=True)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 1e-1), (torch.float16, 2e-2)]
)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_the_kernels_on_cuda(_: None, dtype: torch.dtype, tolerance: float) -> None:
    check_projections("cuda", dtype, tolerance)
    check_attention("cuda", dtype, tolerance)
    check_model("cuda", dtype, tolerance)


def test_a_tile_holds_whole_groups_of_query_heads() -> None:
    assert tile_rows(3) == (64, 21)  # SmolLM2: 9 query heads over 3 KV heads
    assert tile_rows(8) == (64, 8)
    assert tile_rows(128) == (128, 1)


def test_draft_trees_and_mixed_uniform_batches_are_refused() -> None:
    _, _, _, meta, _, _ = build_case([1, 2], [5, 5], 4, torch.float32)
    with pytest.raises(ValueError, match="one query length"):
        InvariantAttention(uniform=True).prepare(meta)
    treed = type(meta)(
        meta.block_size,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.slot_mapping,
        meta.query_lens_host,
        meta.seq_lens_host,
        tail_masks=torch.ones(2, 2, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="draft chains with --deterministic"):
        InvariantAttention().prepare(treed)


def test_a_cpu_model_keeps_its_kernels() -> None:
    """Our CPU kernels give each row its own bits already: `make_deterministic` leaves a CPU
    model as it is, draft trees included."""
    model = tiny_model(0)
    attention = model.attention
    assert make_deterministic(model, tree_nodes=16) is model
    assert model.attention is attention
    assert not any(p.batch_invariant for p in (model.packs, model.layers[0].mlp.packs))


def test_the_kernels_refuse_cpu_tensors_outside_the_interpreter() -> None:
    from kernels import batch_invariant

    x, w = torch.zeros(2, 16), torch.zeros(4, 16)
    assert "CUDA" in str(batch_invariant.problem(x, w))
    with pytest.raises(ValueError, match="CUDA"):
        batch_invariant.linear(x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_a_deterministic_engine_gives_a_request_one_text_on_cuda(
    _: None, dtype: torch.dtype
) -> None:
    """With `deterministic` on a GPU, each request (greedy, or seeded and sampled) gets the same
    tokens alone, among 15 others arriving a step apart, with its prompt cached from an earlier
    asking, with n-gram speculation, and eagerly as from captured graphs."""
    from tests.model.helpers import run_staggered
    from tests.unit.test_cuda import GREEDY, SPEC, make_drafter, prompts, seeded_params
    from workers.engine.config import EngineConfig, RequestSpec
    from workers.engine.graph_runner import GraphRunner
    from workers.engine.llm_engine import LLMEngine

    shape = {"num_heads": 6, "num_kv_heads": 2, "head_dim": 64, "hidden_size": 384}
    model = tiny_model(5, **shape, intermediate_size=1024, num_layers=4).to("cuda", dtype)
    with pytest.raises(ValueError, match="draft chains only"):
        make_deterministic(model, tree_nodes=8)
    prompt_ids = prompts(16, seed=3)
    params = [GREEDY if i % 2 else p for i, p in enumerate(seeded_params(16))]

    def engine(method: str = "none", **config: bool) -> LLMEngine:
        drafters = {} if method == "none" else {method: make_drafter(method, model)}
        settings = EngineConfig(
            max_model_len=512, max_num_seqs=64, deterministic=True, spec=SPEC, **config
        )
        return LLMEngine(model, settings, drafters=drafters)

    def run(eng: LLMEngine, method: str = "none") -> list[list[int]]:
        return run_staggered(eng, prompt_ids, params, RequestSpec(method=method), gap=1)

    cached = engine()
    assert isinstance(cached.runner, GraphRunner)
    assert (
        isinstance(cached.runner.attention, InvariantAttention) and cached.runner.attention.uniform
    )
    assert isinstance(model.attention, InvariantAttention)
    alone = [
        run_staggered(cached, [p], q, RequestSpec())[0]
        for p, q in zip(prompt_ids, params, strict=True)
    ]
    assert run(cached) == alone  # every prompt cached by its lone asking
    assert cached.scheduler.prefix_hit_tokens > 0
    assert run(engine(enable_prefix_caching=False)) == alone
    assert run(engine("ngram"), "ngram") == alone
    assert run(engine(enforce_eager=True)) == alone
