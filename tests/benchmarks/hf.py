"""transformers models on the same weights as ours, for side-by-side benchmarks."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from workers.model.loader import Checkpoint, bundled_model_path, save_safetensors_dir


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
