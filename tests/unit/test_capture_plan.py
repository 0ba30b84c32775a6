"""Every CUDA graph an engine would capture, run on the CPU before any GPU sees it: for each
configuration the factory builds (chains of every k a server allows, draft trees, EAGLE's
feature layers, `--deterministic`, a default server's and a large GPU server's sizes) the graph
runner's `_run` (the function a graph captures) at every shape in its capture plan, and the
EAGLE draft loops' likewise. A sizing slip between what a runner captures and the fixed buffers
its graphs write fails here, not at a GPU server's start-up.

Also: every uniform step the runner would serve maps to a captured shape (a step padded to a
shape without a graph would run eagerly on a GPU, silently slow)."""

from __future__ import annotations

import pytest
import torch

from tests.factories import tiny_eagle_head, tiny_model
from tests.unit.helpers import run_interpreted
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import EagleDraftLoop, loop_config
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.graph_runner import GraphRunner, graph_runner
from workers.engine.model_runner import SeqForward
from workers.model.transformer import TransformerLM

# (name, engine settings) as servers configure them: the deployment defaults (32 sequences, a
# 512-token step), a GPU server's (256 sequences, 2048 tokens), and each speculation setting.
CONFIGS = {
    "plain": dict(spec=SpecConfig(num_speculative_tokens=0)),
    "default-k4": dict(spec=SpecConfig(num_speculative_tokens=4)),
    "k16": dict(spec=SpecConfig(num_speculative_tokens=16)),
    "trees-8": dict(spec=SpecConfig(num_speculative_tokens=4, tree_nodes=8)),
    "trees-20": dict(spec=SpecConfig(num_speculative_tokens=4, tree_nodes=20)),
    "trees-32-k6": dict(spec=SpecConfig(num_speculative_tokens=6, tree_nodes=32)),
    "trees-64": dict(spec=SpecConfig(num_speculative_tokens=8, tree_nodes=64)),
    "gpu-server": dict(
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        spec=SpecConfig(num_speculative_tokens=4, tree_nodes=32, disable_batch_size=64),
    ),
}
EAGLE_LAYERS = (0, 1)  # what the tiny target's EAGLE head reads


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return tiny_model(seed=2, max_position_embeddings=1024)


def engine_config(name: str) -> EngineConfig:
    return EngineConfig(max_model_len=1024, block_size=16, **CONFIGS[name])  # type: ignore[arg-type]


def runner_for(model: TransformerLM, name: str) -> GraphRunner:
    config = engine_config(name)
    return graph_runner(model, config, EAGLE_LAYERS if config.spec.num_speculative_tokens else ())


@torch.inference_mode()
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_captured_shape_runs(model: TransformerLM, name: str) -> None:
    runner = runner_for(model, name)
    assert runner.shapes
    for shape in runner.shapes:
        runner.buffers.stage([], shape)  # all padding, as a capture stages it
        runner._run(shape)
        rows = shape.num_seqs * shape.width
        assert bool(torch.isfinite(runner._logits[rows - 1]).all()), shape


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_uniform_step_has_a_captured_shape(model: TransformerLM, name: str) -> None:
    runner = runner_for(model, name)
    captured = set(runner.shapes)
    config = engine_config(name)
    widths = range(1, runner.buffers.max_width + 1)
    for num_seqs in range(1, runner.sizes[-1] + 1, 7):
        for width in widths:
            seqs = [SeqForward([1] * width, 8, [i], num_logits=width) for i in range(num_seqs)]
            shape = runner.uniform_shape(
                seqs, EAGLE_LAYERS if config.spec.num_speculative_tokens else ()
            )
            if shape is not None:
                assert shape in captured, (num_seqs, width, shape)


def eagle_loops(model: TransformerLM, name: str) -> list[EagleDraftLoop]:
    """The draft loops an engine of `name` gives its EAGLE drafter on a GPU, built here."""
    config = engine_config(name)
    loop = loop_config(config, torch.device("cuda"))
    if loop is None:
        return []
    drafter = EagleDrafter(tiny_eagle_head(model), model, num_blocks=64, block_size=16, loop=loop)
    assert drafter.loop is not None
    return [drafter.loop] + ([drafter.tree_loop] if drafter.tree_loop is not None else [])


@torch.inference_mode()
@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "plain"])
def test_every_captured_draft_loop_shape_runs(model: TransformerLM, name: str) -> None:
    loops = eagle_loops(model, name)
    assert loops
    for loop in loops:
        for shape in loop.shapes:
            loop.stage_padding(shape)
            loop._run(shape)


def test_the_deterministic_plan_runs_interpreted() -> None:
    """`--deterministic`'s batch-invariant kernels are Triton's, which the CPU runs only
    interpreted: a smaller server's plan (4 sequences, k = 4), every shape."""
    run_interpreted(
        """
import torch
from tests.factories import tiny_model
from workers.engine.config import EngineConfig, SpecConfig
from workers.engine.graph_runner import graph_runner
from workers.model.transformer import make_deterministic

model = make_deterministic(tiny_model(seed=2, head_dim=16), 0)
config = EngineConfig(max_model_len=256, max_num_seqs=4, deterministic=True,
                      spec=SpecConfig(num_speculative_tokens=4))
runner = graph_runner(model, config, (0, 1))
with torch.inference_mode():
    for shape in runner.shapes:
        runner.buffers.stage([], shape)
        runner._run(shape)
print("ok")
"""
    )
