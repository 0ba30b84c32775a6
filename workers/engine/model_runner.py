"""One forward pass over a batch of sequences, each bringing its own new tokens."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata
from kernels.tree_attention import TreeShape, tree_rows
from workers.kv_cache import PagedKVCache
from workers.model.transformer import ModelOutput, TransformerLM


@dataclass(slots=True)  # not frozen: made for every sequence every step, and never changed
class SeqForward:
    """One sequence's share of a forward: its new tokens and where they go in the cache."""

    token_ids: Sequence[int]  # the new tokens: a prefill chunk, a decode token, or last + draft
    num_computed_tokens: int  # tokens already cached = position of the first new token
    block_ids: Sequence[int]  # the sequence's block table, covering every new token
    num_logits: int = 1  # score the last `num_logits` new tokens
    # The block table's `BlockTable.version` (0: unknown): equal versions, equal block ids
    block_version: int = 0
    # A draft tree's positions and keys (kernels/tree_attention.py); None: a causal chain
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not 0 <= self.num_logits <= n or not n or self.num_computed_tokens < 0:
            if not n:
                raise ValueError("a sequence in a forward needs at least one new token")
            if self.num_computed_tokens < 0:
                raise ValueError("num_computed_tokens must be >= 0")
            raise ValueError(f"num_logits must be in 0..{n}, got {self.num_logits}")
        if self.tree is not None and len(self.tree.positions) != n:
            raise ValueError("a tree shape needs one position per new token")

    @property
    def end(self) -> int:
        """The position after its last new token."""
        return self.num_computed_tokens + len(self.token_ids)

    def check_room(self, block_size: int, max_positions: int) -> None:
        """Raise unless its new tokens lie inside the context and its block table covers them."""
        end = self.end
        if end > max_positions:
            raise ValueError(
                f"sequence reaches position {end - 1}, past the context {max_positions}"
            )
        if -(-end // block_size) > len(self.block_ids):
            raise ValueError(
                f"block table holds {len(self.block_ids)} blocks, {end} tokens need more"
            )


def check_fed(seqs: Sequence[SeqForward]) -> None:
    """Raise unless each sequence brings one new token, which fed tokens stand in for."""
    if any(len(s.token_ids) != 1 for s in seqs):
        raise ValueError("fed tokens need one new token a sequence")


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64
    query_start_loc: tuple[int, ...]  # host copy, num_seqs + 1 entries
    logits_start_loc: tuple[int, ...]  # where each sequence's logits rows start, num_seqs + 1


def build_inputs(
    seqs: Sequence[SeqForward], block_size: int, max_positions: int, device: torch.device
) -> BatchInputs:
    """Flatten per-sequence chunks into the tensors a forward takes."""
    if not seqs:
        raise ValueError("a forward needs at least one sequence")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    query_start, logits_start = [0], [0]
    trees = []
    for i, seq in enumerate(seqs):
        seq.check_room(block_size, max_positions)
        start, end = seq.num_computed_tokens, seq.end
        row = len(input_ids)
        input_ids += seq.token_ids
        if seq.tree is None:
            positions += range(start, end)
        else:
            positions += seq.tree.positions
            trees.append((i, row, seq.block_ids, seq.tree))
        slots += (
            seq.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        logits_indices += range(row + len(seq.token_ids) - seq.num_logits, row + len(seq.token_ids))
        query_start.append(len(input_ids))
        logits_start.append(len(logits_indices))
    max_blocks = max(len(s.block_ids) for s in seqs)
    tables = [list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)) for s in seqs]

    def as_tensor(
        values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype
    ) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        block_size=block_size,
        query_start_loc=as_tensor(query_start, torch.int32),
        seq_lens=as_tensor([s.num_computed_tokens + len(s.token_ids) for s in seqs], torch.int32),
        block_tables=as_tensor(tables, torch.int32),
        slot_mapping=as_tensor(slots, torch.int64),
        query_lens_host=tuple(len(s.token_ids) for s in seqs),
        seq_lens_host=tuple(s.num_computed_tokens + len(s.token_ids) for s in seqs),
        tree=tree_rows(trees, block_size, device) if trees else None,
    )
    return BatchInputs(
        input_ids=as_tensor(input_ids, torch.int64),
        positions=as_tensor(positions, torch.int64),
        meta=meta,
        logits_indices=as_tensor(logits_indices, torch.int64),
        query_start_loc=tuple(query_start),
        logits_start_loc=tuple(logits_start),
    )


@dataclass(slots=True)
class RunnerOutput:
    """A forward's output and where each sequence's rows are in it: its scored rows in
    `output.logits` and its new tokens' rows in the hidden states, as (start, end) pairs (a
    padded batch leaves gaps between sequences)."""

    output: ModelOutput
    logits_spans: tuple[tuple[int, int], ...]
    token_spans: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, output: ModelOutput, inputs: BatchInputs) -> RunnerOutput:
        def spans(starts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
            return tuple(itertools.pairwise(starts))

        return cls(output, spans(inputs.logits_start_loc), spans(inputs.query_start_loc))

    def logits_of(self, seq_index: int) -> torch.Tensor:  # [num_logits of that seq, vocab]
        start, end = self.logits_spans[seq_index]
        return self.output.logits[start:end]

    def hidden_of(self, layer: int, seq_index: int) -> torch.Tensor:  # [new tokens, hidden]
        start, end = self.token_spans[seq_index]
        return self.output.hidden_states[layer][start:end]


class ModelRunner:
    """Owns a model and its paged KV cache; runs forwards over batches of `SeqForward`."""

    # Whether `forward` takes `input_tokens` (a tensor-parallel group's ranks need every
    # token on the host: cluster/actors.py)
    feeds_tokens = True
    # Whether `forward` stops between layers when its `interrupt` says so (workers/engine/
    # step_interrupt.py)
    interruptible = True

    def __init__(self, model: TransformerLM, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies, before the forward that writes into the copies."""
        self.kv_cache.copy_blocks(copies)

    def write_prefilled(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """A remote prefill's K/V (`[num_layers, 2, n, kv_heads, head_dim]`) into `slots`."""
        self.kv_cache.write_slots(slots, kv)

    @torch.inference_mode()
    def forward(
        self,
        seqs: Sequence[SeqForward],
        hidden_layers: Sequence[int] = (),
        return_final_hidden: bool = False,
        interrupt: Callable[[], bool] | None = None,
        input_tokens: torch.Tensor | None = None,  # [num_seqs] int64, on the model's device
    ) -> RunnerOutput:
        """`input_tokens`: each sequence's one new token, in place of its `token_ids` (a step
        fed the tokens the step before it sampled, before the host has read them:
        workers/engine/overlap.py)."""
        inputs = build_inputs(
            seqs, self.block_size, self.model.config.max_context, self.model.device
        )
        if input_tokens is not None:
            check_fed(seqs)
            inputs.input_ids.copy_(input_tokens)
        output = self.model(
            inputs.input_ids,
            inputs.positions,
            inputs.meta,
            self.kv_cache.layers,
            inputs.logits_indices,
            hidden_layers=hidden_layers,
            return_final_hidden=return_final_hidden,
            interrupt=interrupt,
        )
        return RunnerOutput.of(output, inputs)
