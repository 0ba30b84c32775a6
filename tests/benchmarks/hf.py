"""transformers models on the same weights as ours, for side-by-side benchmarks."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from workers.model.loader import Checkpoint, bundled_model_path, save_safetensors_dir

HF_PAD = 192  # prompts are left-padded to this for the static cache (one shape, one compile)


def dense_transformers(checkpoint: Checkpoint, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' usual dense model, from our dequantized weights written as an HF folder."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        save_safetensors_dir(checkpoint, Path(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


def packed_gguf_transformers(dtype: torch.dtype) -> torch.nn.Module:
    """transformers 5 reading the bundled GGUF: weights stay packed, dequantized per matmul."""
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


class TransformersPeer:
    """transformers' `generate` on the same weights and card."""

    def __init__(self, checkpoint: Checkpoint, max_tokens: int, device: torch.device) -> None:
        self.model = dense_transformers(checkpoint, torch.bfloat16).to(device)
        self.eos = list(checkpoint.tokenizer.eos_token_ids)
        self.max_tokens = max_tokens
        self.device = device

    def generate(self, rows: list[list[int]], padded: bool, **kwargs: Any) -> tuple[int, float]:
        """(tokens up to each row's EOS, seconds); `padded`: left-padded to HF_PAD, so that
        the static cache has one shape whatever the prompt."""
        pad = self.eos[0]
        length = HF_PAD if padded else max(len(r) for r in rows)
        ids = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, length - len(r) :] = torch.tensor(r)
            mask[i, length - len(r) :] = 1
        _sync()
        start = time.perf_counter()
        out = self.model.generate(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=self.max_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=self.eos,
            **kwargs,
        )
        _sync()
        seconds = time.perf_counter() - start
        tokens = 0
        for row in out[:, length:].tolist():
            ends = [i for i, t in enumerate(row) if t in self.eos]
            tokens += ends[0] + 1 if ends else len(row)
        return tokens, seconds

    def single(
        self, prompts: dict[str, list[list[int]]], rounds: int, padded: bool, **kwargs: Any
    ) -> dict[str, float]:
        """tokens/s of each kind's prompts one at a time (after a warm-up that compiles)."""
        self.generate(prompts["open chat"], padded, **kwargs)
        rates = {}
        for kind, kind_prompts in prompts.items():
            samples = []
            for _ in range(rounds):
                done = [self.generate([p], padded, **kwargs) for p in kind_prompts]
                samples.append(sum(n for n, _ in done) / sum(t for _, t in done))
            rates[kind] = statistics.median(samples)
        return rates

    def batch(self, rows: list[list[int]]) -> float:
        """tokens/s of `rows` at once through the static cache (after a compiling warm-up)."""
        self.generate(rows, True, cache_implementation="static")
        tokens, seconds = self.generate(rows, True, cache_implementation="static")
        return tokens / seconds


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
