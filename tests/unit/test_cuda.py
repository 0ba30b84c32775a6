"""The engine with its model on a CUDA device keeps the promises it keeps on the CPU: our model
computes what it computes on the CPU, greedy speculative output equals plain decoding for every
drafter, and a seeded sampled request draws the same tokens whatever else is in its batch.

Each engine test runs on the CPU too, so CI (which has no GPU) checks the tests themselves;
`pytest -m cuda` runs the CUDA cases where a GPU is. fp32 with TF32 off, so that a forward's
logits do not depend on how many tokens it scores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels.rotary import RopeScaling
from tests.factories import tiny_eagle_head, tiny_model
from tests.model.helpers import all_logits, run_staggered
from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.model.transformer import TransformerLM

CUDA = torch.device("cuda")
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SPEC = SpecConfig(num_speculative_tokens=4, adaptive=False, disable_batch_size=64)
# EAGLE's draft trees of 12 nodes, kept whole (k fixed): on a GPU their steps replay graphs of
# widths 9 and 13 (workers/engine/graph_runner.py `tree_widths`).
TREE_SPEC = SpecConfig(
    num_speculative_tokens=4, adaptive=False, disable_batch_size=64, tree_nodes=12
)
METHODS = ["ngram", "suffix", "draft_model", "self_draft", "eagle", "eagle_tree"]


def spec_for(method: str) -> SpecConfig:
    return TREE_SPEC if method == "eagle_tree" else SPEC


@pytest.fixture(scope="module", autouse=True)
def _no_tf32() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def model(request: pytest.FixtureRequest) -> TransformerLM:
    return tiny_model(seed=4, max_position_embeddings=512).to(request.param)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so n-gram drafts get accepted) at different lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in torch.randint(3, 24, (n,), generator=gen).tolist():
        piece = torch.randint(3, 90, (length,), generator=gen).tolist()
        out.append(piece * 2 + piece[: length // 2])
    return out


def seeded_params(n: int) -> list[SamplingParams]:
    """Seeded sampled requests, every other one with its logits adjusted before sampling."""
    return [
        SamplingParams(
            max_tokens=12,
            temperature=0.8,
            top_p=0.9,
            seed=7 + i,
            ignore_eos=True,
            frequency_penalty=0.5 * (i % 2),
            logit_bias=((3, 2.0),) if i % 2 else (),
        )
        for i in range(n)
    ]


def make_drafter(method: str, model: TransformerLM) -> Drafter:
    if method == "ngram":
        return NgramDrafter(NgramConfig(1, 3))
    if method == "suffix":
        return SuffixDrafter(NgramConfig(1, 3))
    if method in ("eagle", "eagle_tree"):  # trees where the engine's spec asks for them
        return EagleDrafter(tiny_eagle_head(model), model, num_blocks=256, block_size=8)
    # A model that disagrees with the target often, or the target itself (always agrees).
    net = model if method == "self_draft" else tiny_model(seed=5).to(model.device)
    return DraftModelDrafter(net, num_blocks=256, block_size=8)


def engine(
    model: TransformerLM, drafter: Drafter | None = None, spec: SpecConfig = SPEC
) -> LLMEngine:
    drafters = {} if drafter is None else {drafter.method: drafter}
    config = EngineConfig(max_model_len=512, block_size=8, spec=spec)
    return LLMEngine(model, config, drafters=drafters)


ARCHITECTURES = {  # tiny_model overrides: each architecture's own pieces on the device path
    "llama": {},
    "qwen3": {"architecture": "qwen3", "qk_norm": True, "tie_word_embeddings": False},
    "llama3.1": {"rope_scaling": RopeScaling("llama3", factor=8.0, original_max_positions=32)},
    "yarn": {
        "rope_scaling": RopeScaling(
            "yarn", factor=4.0, original_max_positions=32, attention_factor=1.14
        )
    },
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_the_model_computes_on_cuda_what_it_computes_on_the_cpu(_: None, arch: str) -> None:
    overrides = ARCHITECTURES[arch]
    cpu_model = tiny_model(seed=4, max_position_embeddings=512, **overrides)
    model = tiny_model(seed=4, max_position_embeddings=512, **overrides).to(CUDA)
    prompt = prompts(1, seed=9)[0]
    plain_cpu = SequentialEngine(cpu_model, max_model_len=512)
    plain_cuda = SequentialEngine(model, max_model_len=512)
    assert plain_cuda.generate(prompt, GREEDY).token_ids == (
        plain_cpu.generate(prompt, GREEDY).token_ids
    )
    got = all_logits(model, prompt)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), all_logits(cpu_model, prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_on_cuda_equals_plain_decoding(
    model: TransformerLM, method: str, batch: int
) -> None:
    prompt_ids = prompts(batch, seed=batch)
    plain = SequentialEngine(model, max_model_len=512)
    expected = [plain.generate(p, GREEDY).token_ids for p in prompt_ids]
    drafter = make_drafter(method, model)
    eng = engine(model, drafter, spec_for(method))
    got = run_staggered(eng, prompt_ids, GREEDY, RequestSpec(method=drafter.method))
    assert got == expected
    assert eng.stats.drafted > 0
    if method == "self_draft":
        assert eng.stats.accepted == eng.stats.drafted
    assert eng.allocator.num_free_blocks == eng.config.kv_blocks


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle", "eagle_tree"])
def test_a_seeded_sampled_request_draws_the_same_alone_or_in_a_batch(
    model: TransformerLM, method: str
) -> None:
    """(With trees, the adjusted requests draft chains and the others trees.)"""
    prompt_ids = prompts(4, seed=21)
    params = seeded_params(4)
    drafted_by = "eagle" if method == "eagle_tree" else method
    spec = RequestSpec(enabled=False) if method == "none" else RequestSpec(method=drafted_by)

    def fresh() -> LLMEngine:
        drafter = None if method == "none" else make_drafter(method, model)
        return engine(model, drafter, spec_for(method))

    together = run_staggered(fresh(), prompt_ids, params, spec)
    pairs = zip(prompt_ids, params, strict=True)
    alone = [run_staggered(fresh(), [p], [sp], spec)[0] for p, sp in pairs]
    assert together == alone
    assert all(len(tokens) == 12 for tokens in together)


def test_a_remote_prefill_from_host_memory_lands_on_the_device(model: TransformerLM) -> None:
    """A prefill worker's K/V and hidden states arrive in host memory over a gloo link (a worker
    on a CPU, or on a GPU of another node): the engine and its EAGLE drafter take them onto
    their device, and the output is plain decoding's."""
    from cluster.prefill import PrefillWorker
    from workers.engine.outputs import Prefilled

    prompt_ids = prompts(3, seed=31)
    plain = SequentialEngine(model, max_model_len=512)
    expected = [plain.generate(p, GREEDY).token_ids for p in prompt_ids]
    drafter = make_drafter("eagle", model)
    eng = engine(model, drafter)
    worker = PrefillWorker(model, max_model_len=256, block_size=8)
    spec = RequestSpec(method="eagle")
    for i, p in enumerate(prompt_ids):
        result = worker.compute(p[:-1], hidden_layers=drafter.hidden_layers)
        hidden = {layer: rows.cpu() for layer, rows in result.hidden.items()}
        eng.add_request(f"r{i}", p, GREEDY, spec, prefilled=Prefilled(result.kv.cpu(), hidden))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == expected
    assert eng.stats.drafted > 0


@pytest.fixture(scope="module")
def graph_model() -> TransformerLM:
    """Heads of 16 dimensions, so that decode and verification run the Triton kernel."""
    return tiny_model(seed=10, max_position_embeddings=512, head_dim=16).to(CUDA)


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_graph_replay_gives_eagers_output(
    _: None, graph_model: TransformerLM, method: str, batch: int
) -> None:
    """Greedy output with captured graphs (batches padded to their buckets, drafts to the
    widest) equals the eager engine's and plain decoding's, fp32."""
    from workers.engine.graph_runner import GraphRunner

    prompt_ids = prompts(batch, seed=batch + 40)
    plain = SequentialEngine(graph_model, max_model_len=512)
    expected = [plain.generate(p, GREEDY).token_ids for p in prompt_ids]
    outputs = []
    for eager in (True, False):
        drafter = make_drafter(method, graph_model)
        config = EngineConfig(
            max_model_len=512,
            block_size=8,
            max_num_seqs=64,
            spec=spec_for(method),
            enforce_eager=eager,
        )
        eng = LLMEngine(graph_model, config, drafters={drafter.method: drafter})
        assert isinstance(eng.runner, GraphRunner) is not eager
        spec = RequestSpec(method=drafter.method)
        outputs.append(run_staggered(eng, prompt_ids, GREEDY, spec, gap=1))
        if not eager:
            assert isinstance(eng.runner, GraphRunner)
            assert eng.runner.num_replays > 0
            assert eng.runner.attention.name == "triton"
    assert outputs[0] == outputs[1] == expected


@pytest.mark.parametrize(
    ("batch", "kv_blocks", "trees"),
    [(1, 0, False), (4, 0, False), (16, 48, False), (64, 0, False), (1, 0, True), (4, 0, True)],
)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda)])
def test_graph_drafted_eagle_gives_plain_decodings_output(
    _: None, graph_model: TransformerLM, batch: int, kv_blocks: int, trees: bool
) -> None:
    """EAGLE drafting from its captured draft loop (up to 64 sequences a replay), the target
    replaying its graphs: greedy output equals plain decoding, fp32, also where a KV cache too
    small for the batch preempts and recomputes requests (`kv_blocks`), and with draft trees
    drafted by the tree loop's graphs and verified by the runner's tree widths (`trees`)."""
    from workers.drafting.eagle_loop import LoopConfig

    prompt_ids = prompts(batch, seed=batch + 70)
    plain = SequentialEngine(graph_model, max_model_len=512)
    expected = [plain.generate(p, GREEDY).token_ids for p in prompt_ids]
    head = tiny_eagle_head(graph_model)
    spec = TREE_SPEC if trees else SPEC
    loop = LoopConfig(64, spec.num_speculative_tokens, tree_nodes=spec.tree_nodes)
    drafter = EagleDrafter(head, graph_model, num_blocks=1024, block_size=8, loop=loop)
    assert drafter.capture() is not None
    config = EngineConfig(
        max_model_len=512, block_size=8, max_num_seqs=64, num_kv_blocks=kv_blocks, spec=spec
    )
    eng = LLMEngine(graph_model, config, drafters={"eagle": drafter})
    got = run_staggered(eng, prompt_ids, GREEDY, RequestSpec(method="eagle"), gap=1)
    assert got == expected
    replayed = drafter.tree_loop if trees else drafter.loop  # trees asked for every step
    assert replayed is not None and replayed.num_replays > 0
    if kv_blocks:
        assert eng.scheduler.num_preemptions > 0


ADJUSTED = SamplingParams(
    max_tokens=16,
    temperature=0,
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.2,
    logit_bias=((5, 3.0), (9, -2.0)),
    bad_words=((7, 8), (11,)),
    min_tokens=6,
    stop_token_ids=(1,),
)


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
def test_adjusted_logits_give_the_cpus_greedy_output(model: TransformerLM, method: str) -> None:
    """Penalties, a logit bias, bad words and min_tokens, applied where the logits are: the
    engine on its device (graphs and the device sampler on a GPU) commits what plain decoding
    on the CPU does."""
    cpu_model = tiny_model(seed=4, max_position_embeddings=512)
    prompt_ids = prompts(4, seed=60)
    plain = SequentialEngine(cpu_model, max_model_len=512)
    expected = [plain.generate(p, ADJUSTED).token_ids for p in prompt_ids]
    spec = RequestSpec(enabled=False) if method == "none" else RequestSpec(method=method)
    eng = engine(model, None if method == "none" else make_drafter(method, model))
    assert run_staggered(eng, prompt_ids, ADJUSTED, spec) == expected
