"""A model runner whose decode and verify steps replay captured CUDA graphs.

A step in which every sequence brings its last token and a draft of at most k tokens (plain
decode is k = 0) is a uniform batch: `num_seqs` sequences x `width` = 1 + max k new tokens.
`GraphRunner` pads such a step up to the next captured batch size (1, 2, 4, 8, then every 16
up to `max_num_seqs`, as nano-vllm does), writes its inputs into persistent buffers
(workers/engine/step_buffers.py) and replays the graph captured for that shape: one launch for
the whole forward instead of hundreds, which on a GPU is most of a small model's step.
Everything else (prefill chunks, steps wider or larger than any graph, a step that wants the
final hidden state) runs eagerly through `ModelRunner.forward`, unchanged.

Uniform steps attend through a uniform-batch backend (the Triton kernel on a GPU, the torch
reference elsewhere: kernels/attention_uniform.py); on a CPU, or with `enforce_eager`, they run
the same padded path without graphs, which is how CI tests the padding.

Graphs write their outputs into fixed buffers (logits, and the hidden states of the layers
drafters read), so the memory of all graphs together is one forward at the largest shape plus
those buffers. Capture happens once, at start-up (`capture`), largest shape first into one
shared memory pool; it logs its time and memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.attention_invariant import InvariantAttention
from kernels.attention_uniform import MAX_TREE_WIDTH, select_uniform_backend
from workers.engine.config import EngineConfig
from workers.engine.model_runner import ModelRunner, RunnerOutput, SeqForward, check_fed
from workers.engine.step_buffers import StepBuffers, UniformShape
from workers.kv_cache import PagedKVCache
from workers.model.transformer import ModelOutput, TransformerLM, make_deterministic

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes |= set(range(16, max_num_seqs + 1, 16))
    return sorted(sizes | {max_num_seqs})


@dataclass(frozen=True, slots=True)
class CaptureReport:
    num_graphs: int
    seconds: float
    memory_bytes: int  # device memory the capture took (pool and buffers)


Shape = TypeVar("Shape", bound=Hashable)


def capture_graphs(
    shapes: Sequence[Shape],
    stage: Callable[[Shape], None],
    run: Callable[[Shape], None],
    progress: bool = False,
) -> tuple[dict[Shape, torch.cuda.CUDAGraph], CaptureReport]:
    """A CUDA graph of `run(shape)` for every shape, in order (largest first, so later ones fit
    in what the first took) into one shared memory pool, each after `stage(shape)` has written
    inputs the capture may run on and one run outside the capture (lazy inits, autotuning)."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
    with torch.inference_mode():
        for shape in tqdm(shapes, desc="capturing CUDA graphs", disable=not progress):
            stage(shape)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run(shape)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                run(shape)
            graphs[shape] = graph
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = CaptureReport(len(graphs), seconds, free_before - torch.cuda.mem_get_info()[0])
    return graphs, report


def replay_or_run(
    graphs: Mapping[Shape, torch.cuda.CUDAGraph], shape: Shape, run: Callable[[Shape], None]
) -> bool:
    """Replay the graph captured for `shape`, or run it eagerly where none was (on a CPU, say);
    whether a graph ran."""
    graph = graphs.get(shape)
    if graph is None:
        run(shape)
        return False
    graph.replay()
    return True


class GraphRunner(ModelRunner):
    """`ModelRunner` with uniform decode/verify steps on persistent buffers, replayed from CUDA
    graphs where captured (see the module docstring)."""

    interruptible = False  # a replayed graph runs whole; its steps take a millisecond or two

    def __init__(
        self,
        model: TransformerLM,
        kv_cache: PagedKVCache,
        *,
        attention: AttentionBackend,
        max_num_seqs: int,
        max_width: int,
        max_graph_tokens: int,
        scratch_block: int,
        hidden_layers: Sequence[int] = (),
        max_model_len: int | None = None,
        tree_widths: Sequence[int] = (),
        max_tree_seqs: int = 0,
    ) -> None:
        """`max_model_len` (default: the model's whole context) sizes the block tables: each
        step stages and copies `max_num_seqs` of them, so a 128k-context model served at 8k
        stages a sixteenth of what its full context would take. `tree_widths`: wider steps
        captured for draft trees (a tree's nodes and its root, padded up to the next), at
        batch sizes up to `max_tree_seqs`; with them every graph reads tail masks
        (kernels/attention_uniform.py) and a tree's step replays as a chain's does."""
        super().__init__(model, kv_cache)
        if not 0 <= scratch_block < kv_cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache")
        self.attention = attention
        self.max_width = max_width
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        self.sizes = capture_sizes(max_num_seqs)
        self.max_graph_tokens = max_graph_tokens
        self.tree_widths = tuple(sorted(w for w in set(tree_widths) if w > max_width))
        self.max_tree_seqs = max_tree_seqs if self.tree_widths else 0
        widest = max((max_width, *self.tree_widths))
        block_size = kv_cache.block_size
        max_len = min(
            max_model_len or model.config.max_context,
            model.config.max_context,
        )
        self.buffers = StepBuffers(
            max_num_seqs=self.sizes[-1],
            max_width=widest,
            max_blocks=-(-(max_len + widest) // block_size),
            block_size=block_size,
            scratch_slot=scratch_block * block_size,
            max_positions=model.config.max_context,
            device=model.device,
            trees=bool(self.tree_widths),
        )
        # The fixed outputs hold the widest padded step a graph or the padded path serves (a
        # tree's included): no more than a step's token budget (a 128k vocabulary's fp32
        # logits are 0.5 MB a row).
        num_tokens = max((s.num_seqs * s.width for s in self.shapes), default=0)
        self.max_rows = num_tokens
        device, vocab = model.device, model.config.vocab_size
        self._logits = torch.zeros(num_tokens, vocab, dtype=torch.float32, device=device)
        self._hidden = {
            layer: torch.zeros(
                num_tokens, model.config.hidden_size, dtype=model.dtype, device=device
            )
            for layer in self.hidden_layers
        }
        self._all_rows = torch.arange(num_tokens, device=device)
        self._graphs: dict[UniformShape, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0  # uniform steps served by a graph
        self.num_padded_steps = 0  # uniform steps served without one

    @property
    def shapes(self) -> list[UniformShape]:
        """Every shape a graph is captured for (and the padded path serves), largest first:
        each captured batch size at each width it serves, within the step's token budget."""
        return [
            UniformShape(b, w)
            for b in reversed(self.sizes)
            for w in reversed(self._widths(b))
            if b * w <= self.max_graph_tokens
        ]

    def _widths(self, num_seqs: int) -> list[int]:
        """The widths captured at batch size `num_seqs`: 1 .. max_width, and the tree widths
        where trees are drafted (up to `max_tree_seqs` sequences)."""
        chains = list(range(1, self.max_width + 1))
        return chains + list(self.tree_widths) if num_seqs <= self.max_tree_seqs else chains

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture(self, progress: bool = True) -> CaptureReport:
        """Capture a graph for every shape (CUDA only)."""
        if self.model.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model on a CUDA device")
        # Staged as all padding: a capture writes only the scratch slot.
        graphs, report = capture_graphs(
            self.shapes, lambda shape: self.buffers.stage([], shape), self._run, progress
        )
        self._graphs.update(graphs)
        log.info(
            "captured %d CUDA graphs (batch sizes %s, widths 1..%d) in %.1f s, %.0f MiB",
            report.num_graphs,
            self.sizes,
            self.max_width,
            report.seconds,
            report.memory_bytes / 2**20,
        )
        return report

    def uniform_shape(
        self,
        seqs: Sequence[SeqForward],
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
    ) -> UniformShape | None:
        """The padded shape this forward runs at, or None where it runs eagerly: any sequence
        with a prompt chunk to compute before its scored tokens or a draft tree, more
        sequences or tokens than
        the buffers hold (padded, past `max_graph_tokens`), layers no graph keeps, or the final
        hidden state wanted."""
        if return_final_hidden or not set(hidden_layers) <= set(self.hidden_layers):
            return None
        if not seqs or len(seqs) > self.sizes[-1]:
            return None
        width, trees = 0, False
        max_width, max_blocks = self.buffers.max_width, self.buffers.max_blocks
        for s in seqs:  # one pass: this runs for every sequence every step
            n = len(s.token_ids)
            if s.num_logits != n or n > max_width or len(s.block_ids) > max_blocks:
                return None
            if n > width:
                width = n
            if s.tree is not None:
                trees = True
        b = next(size for size in self.sizes if size >= len(seqs))
        if trees or width > self.max_width:  # a captured width that holds it, if any
            if not self.tree_widths or b > self.max_tree_seqs:
                return None
            width = next((w for w in self._widths(b) if w >= width), 0)
            if not width:
                return None
        return UniformShape(b, width) if b * width <= self.max_rows else None

    @torch.inference_mode()
    def forward(
        self,
        seqs: Sequence[SeqForward],
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
        interrupt: Callable[[], bool] | None = None,
        input_tokens: torch.Tensor | None = None,
    ) -> RunnerOutput:
        shape = None if interrupt else self.uniform_shape(seqs, hidden_layers, return_final_hidden)
        if shape is None:
            return super().forward(
                seqs, hidden_layers, return_final_hidden, interrupt, input_tokens
            )
        for seq in seqs:
            seq.check_room(self.block_size, self.model.config.max_context)
        self.buffers.stage(seqs, shape)
        if input_tokens is not None:  # each sequence's one token, over what was staged
            check_fed(seqs)
            width = shape.width
            self.buffers.views(shape).input_ids[: len(seqs) * width : width].copy_(input_tokens)
        if replay_or_run(self._graphs, shape, self._run):
            self.num_replays += 1
        else:
            self.num_padded_steps += 1
        rows = shape.num_seqs * shape.width
        output = ModelOutput(
            self._logits[:rows], {layer: h[:rows] for layer, h in self._hidden.items()}
        )
        spans = tuple(
            (i * shape.width, i * shape.width + len(s.token_ids)) for i, s in enumerate(seqs)
        )
        return RunnerOutput(output, spans, spans)

    def _run(self, shape: UniformShape) -> None:
        """The forward at `shape` on the persistent buffers, its outputs into the fixed ones
        (what a graph captures)."""
        t = self.buffers.views(shape)
        rows = shape.num_seqs * shape.width
        meta = AttentionMetadata(
            block_size=self.block_size,
            query_start_loc=t.seq_lens,  # unused by uniform backends
            seq_lens=t.seq_lens,
            block_tables=t.block_tables,
            slot_mapping=t.slot_mapping,
            query_lens_host=(shape.width,) * shape.num_seqs,
            seq_lens_host=(shape.width,) * shape.num_seqs,
            tail_masks=t.tail_masks if self.buffers.trees else None,
        )
        out = self.model(
            t.input_ids,
            t.positions,
            meta,
            self.kv_cache.layers,
            self._all_rows[:rows],
            hidden_layers=self.hidden_layers,
            attention=self.attention,
        )
        self._logits[:rows].copy_(out.logits)
        for layer, h in self._hidden.items():
            h[:rows].copy_(out.hidden_states[layer])


def make_runner(
    model: TransformerLM,
    config: EngineConfig,
    hidden_layers: Sequence[int] = (),
    progress: bool = False,
) -> ModelRunner:
    """The engine's runner: on a GPU a `GraphRunner` with its graphs captured (unless
    `config.enforce_eager`), elsewhere a plain `ModelRunner`. The cache holds
    `config.kv_blocks` blocks, plus the scratch block padding writes into."""
    if config.deterministic:
        make_deterministic(model, config.spec.tree_nodes)
    if model.device.type != "cuda" or config.enforce_eager:
        cache = PagedKVCache(
            model.config, config.kv_blocks, config.block_size, model.dtype, model.device
        )
        return ModelRunner(model, cache)
    runner = graph_runner(model, config, hidden_layers)
    runner.capture(progress)
    return runner


def graph_runner(
    model: TransformerLM, config: EngineConfig, hidden_layers: Sequence[int] = ()
) -> GraphRunner:
    """The `GraphRunner` an engine of `config` gets on a GPU, its graphs not captured yet (on
    any device: tests/unit/test_capture_plan.py runs every shape it would capture on the
    CPU)."""
    num_blocks, block_size = config.kv_blocks, config.block_size
    cache = PagedKVCache(model.config, num_blocks + 1, block_size, model.dtype, model.device)
    max_width = 1 + config.spec.num_speculative_tokens
    trees = tree_widths(config.spec.tree_nodes, max_width)
    shape = model.config
    attention = (
        InvariantAttention(uniform=True)
        if config.deterministic
        else select_uniform_backend(
            model.device,
            model.dtype,
            shape.head_dim,
            shape.num_heads // shape.num_kv_heads,
            max((max_width, *trees)),
        )
    )
    log.info(
        "decode/verify attention: %s; other forwards: %s", attention.name, model.attention.name
    )
    return GraphRunner(
        model,
        cache,
        attention=attention,
        max_num_seqs=config.max_num_seqs,
        max_width=max_width,
        max_graph_tokens=config.max_num_batched_tokens,
        scratch_block=num_blocks,
        hidden_layers=hidden_layers,
        max_model_len=config.max_model_len,
        tree_widths=trees,
        max_tree_seqs=config.spec.disable_batch_size,
    )


def tree_widths(tree_nodes: int, max_width: int) -> list[int]:
    """The widths a graph runner captures for draft trees of up to `tree_nodes` nodes: 9, 17,
    33 up to the largest tree (its nodes and its root), within a tail mask's bits."""
    if not tree_nodes:
        return []
    largest = min(tree_nodes + 1, MAX_TREE_WIDTH)
    steps = [w for w in (9, 17, 33) if max_width < w < largest]
    return [*steps, largest] if largest > max_width else steps
