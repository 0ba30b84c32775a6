"""Build an engine from model paths and settings: what the CLI and servers call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.eagle.head import BUNDLED_HEAD, EagleHead
from workers.engine.calibration import forward_times, relative_token_cost
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
    eagle_head: str | None = None  # an EAGLE head file; the bundled model has one built in


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
    draft_costs: dict[str, float] = {}
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
        draft_costs["draft_model"] = relative_token_cost(draft, target)
    elif config.spec.method == "draft_model":
        raise ValueError("spec method draft_model needs --draft-model or --draft-layers")
    head_path = spec.eagle_head or (BUNDLED_HEAD if spec.model is None else None)
    if head_path is not None and Path(head_path).exists():
        head = EagleHead.load(Path(head_path))
        eagle = EagleDrafter(
            head,
            target,
            num_blocks=config.kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
        )
        drafters["eagle"] = eagle
        draft_costs["eagle"] = eagle.token_seconds() / forward_times(target, [1], reps=5)[0]
    elif spec.eagle_head is not None:
        raise FileNotFoundError(f"EAGLE head {spec.eagle_head} not found")
    elif config.spec.method == "eagle":
        raise ValueError("spec method eagle needs --eagle-head (built in for the bundled model)")
    engine = LLMEngine(
        target,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.tokenizer.eos_token_ids,
        drafters=drafters,
        draft_costs=draft_costs,
    )
    return LoadedEngine(engine, checkpoint.tokenizer, spec.model or BUNDLED_MODEL_NAME)
