"""Plain decoding of one request at a time over the paged cache: chunked prefill, then decode.

This is the reference the speculative engine is checked against (greedy output must match it
token for token) and what `outrider generate` runs. Continuous batching and speculation live in
the scheduler-driven engine built on the same `ModelRunner`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.sampling import sample_from_probs
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import Grammars
from workers.engine.verification import is_dead
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 512


@dataclass(slots=True)
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop token) or "length"
    elapsed_s: float  # first forward to last token
    first_token_s: float  # first forward to first token (time to first token)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


class SequentialEngine:
    """Generates for one request at a time with a model and its own paged KV cache."""

    def __init__(
        self,
        model: TransformerLM,
        *,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        tokenizer: Tokenizer | None = None,  # for structured output
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.max_model_len = min(
            max_model_len or model.config.max_context,
            model.config.max_context,
        )
        num_blocks = -(-self.max_model_len // block_size)
        cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, cache)
        self.allocator = BlockAllocator(num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        vocab = model.config.vocab_size
        self._grammars = None if tokenizer is None else Grammars(tokenizer, vocab, eos_token_ids)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Tokens after the prompt until EOS, a stop token, max_tokens, the context's end, or a
        position where the request's settings leave no token."""
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the context holds {self.max_model_len}"
            )
        grammar = None
        if params.structured is not None:
            if self._grammars is None:
                raise ValueError("structured output needs an engine with a tokenizer")
            grammar = self._grammars.start(params.structured)
        generator = _generator(params.seed)
        table = BlockTable(self.allocator, self.runner.block_size)
        tokens = list(prompt)
        start = time.perf_counter()
        first_token_s = 0.0
        try:
            logits = self._prefill(table, prompt)
            while True:
                if params.adjusts_logits:
                    output = tokens[len(prompt) :]
                    logits = params.adjust(logits, prompt, output, (), self.eos_token_ids, grammar)
                    if bool(is_dead(logits.view(1, -1))):  # no token may come next: it ends
                        reason = "stop"
                        break
                token = self._sample(logits, params, generator)
                if grammar is not None and not grammar.advance([token]):
                    reason = "stop"  # refused (the mask should have ruled it out)
                    break
                tokens.append(token)
                if not first_token_s:
                    first_token_s = time.perf_counter() - start
                if on_tokens is not None:
                    on_tokens([token])
                reason = self._finish_reason(token, len(tokens) - len(prompt), len(tokens), params)
                if grammar is not None and grammar.stopped:  # the answer is complete
                    reason = "stop"
                if reason:
                    break
                logits = self._decode(table, tokens)
        finally:
            table.release()
        return GenerationResult(
            prompt, tokens[len(prompt) :], reason, time.perf_counter() - start, first_token_s
        )

    def _prefill(self, table: BlockTable, prompt: list[int]) -> torch.Tensor:
        logits = torch.empty(0)
        for start in range(0, len(prompt), self.prefill_chunk):
            chunk = prompt[start : start + self.prefill_chunk]
            logits = self._forward(table, chunk, start)
        return logits

    def _decode(self, table: BlockTable, tokens: list[int]) -> torch.Tensor:
        return self._forward(table, tokens[-1:], len(tokens) - 1)

    def _forward(self, table: BlockTable, new_tokens: list[int], start: int) -> torch.Tensor:
        copies = table.prepare_write(start, start + len(new_tokens))
        self.runner.kv_cache.copy_blocks(copies)
        out = self.runner.forward([SeqForward(new_tokens, start, table.block_ids)])
        return out.output.logits  # [1, vocab]

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> int:
        if params.greedy:
            return int(logits[0].argmax())
        return int(sample_from_probs(params.probs(logits), [generator])[0])

    def _finish_reason(
        self, token: int, num_generated: int, num_tokens: int, params: SamplingParams
    ) -> str:
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return "stop"
        if num_generated >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return ""


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)
