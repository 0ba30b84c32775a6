"""Build an engine from model paths and settings: what the CLI and servers call."""

from __future__ import annotations

from dataclasses import dataclass

from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.engine.calibration import relative_token_cost
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.model.loader import (
    BUNDLED_MODEL_NAME,
    build_model,
    load_checkpoint,
    parse_dtype,
    truncate_layers,
)
from workers.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model: str | None = None  # GGUF file, HF folder, or None for the bundled model
    dtype: str = "float32"
    draft_model: str | None = None  # a smaller model with the same tokenizer
    draft_layers: int | None = None  # or: the target's first N layers as the draft model


@dataclass(slots=True)
class LoadedEngine:
    engine: LLMEngine
    tokenizer: Tokenizer
    model_name: str


def build_engine(spec: ModelSpec, config: EngineConfig, progress: bool = True) -> LoadedEngine:
    checkpoint = load_checkpoint(spec.model, progress=progress)
    dtype = parse_dtype(spec.dtype)
    target = build_model(checkpoint, dtype=dtype)
    ngram = NgramConfig(config.spec.ngram_min, config.spec.ngram_max)
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(ngram), "suffix": SuffixDrafter(ngram)}
    draft_cost = 0.0
    if spec.draft_model is not None or spec.draft_layers is not None:
        if spec.draft_model is not None:
            draft_checkpoint = load_checkpoint(spec.draft_model, progress=progress)
        else:
            draft_checkpoint = truncate_layers(checkpoint, spec.draft_layers or 1)
        if draft_checkpoint.config.vocab_size != checkpoint.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_checkpoint.config.vocab_size}) differs "
                f"from the target's ({checkpoint.config.vocab_size}); they must share a tokenizer"
            )
        draft = build_model(draft_checkpoint, dtype=dtype)
        drafters["draft_model"] = DraftModelDrafter(
            draft,
            num_blocks=config.kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
        )
        draft_cost = relative_token_cost(draft, target)
    elif config.spec.method == "draft_model":
        raise ValueError("spec method draft_model needs --draft-model or --draft-layers")
    engine = LLMEngine(
        target,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.tokenizer.eos_token_ids,
        drafters=drafters,
        draft_model_cost=draft_cost,
    )
    return LoadedEngine(engine, checkpoint.tokenizer, spec.model or BUNDLED_MODEL_NAME)
