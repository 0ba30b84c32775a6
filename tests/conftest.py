"""Shared fixtures: the bundled model, ours and the transformers oracle, loaded once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a hub


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep Outrider's derived files (tokenizer cache) out of the user's home."""
    path = tmp_path_factory.mktemp("outrider-cache")
    old = os.environ.get("OUTRIDER_CACHE_DIR")
    os.environ["OUTRIDER_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("OUTRIDER_CACHE_DIR", None)
    else:
        os.environ["OUTRIDER_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def checkpoint(_isolated_cache: Path):  # type: ignore[no-untyped-def]
    from workers.model.loader import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="session")
def model_fp32(checkpoint):  # type: ignore[no-untyped-def]
    from workers.model.loader import build_model

    return build_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="session")
def quantized_checkpoint(_isolated_cache: Path):  # type: ignore[no-untyped-def]
    """The bundled model as a deployment loads it on a CPU: its Q4_1/Q8_0 blocks kept."""
    from workers.model.loader import load_checkpoint

    return load_checkpoint(quantization="gguf")


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    """transformers' own reading of the same GGUF, in fp32: the oracle."""
    transformers = pytest.importorskip("transformers")
    from workers.model.loader import bundled_model_path

    path = bundled_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    from workers.model.loader import bundled_model_path

    path = bundled_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CPU_FORMATS = {  # every dtype and weight format a CPU deployment offers
    "bf16-blocks": (torch.bfloat16, "gguf"),
    "fp32-blocks": (torch.float32, "gguf"),
    "bf16": (torch.bfloat16, "none"),
    "fp32": (torch.float32, "none"),
}


@pytest.fixture(params=list(CPU_FORMATS))
def cpu_format_model(request, checkpoint, quantized_checkpoint):  # type: ignore[no-untyped-def]
    """The bundled model in each of `CPU_FORMATS` (a test per format), where our kernels give
    every row of a forward its own bits (skipped elsewhere)."""
    from kernels.linear import row_independent_rows
    from workers.model.loader import build_model

    dtype, quantization = CPU_FORMATS[request.param]
    if row_independent_rows(dtype) < 64:
        pytest.skip("needs our native kernels for every row")
    source = checkpoint if quantization == "none" else quantized_checkpoint
    return build_model(source, dtype=dtype)
