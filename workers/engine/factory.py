"""Build an engine from model paths and settings: what the CLI and servers call."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import loop_config
from workers.drafting.ngram import NgramConfig, NgramDrafter, SuffixDrafter
from workers.drafting.user import DrafterContext, load_user_drafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head
from workers.engine.calibration import forward_times
from workers.engine.config import EngineConfig, is_user_method
from workers.engine.llm_engine import LLMEngine
from workers.engine.structured import Grammars
from workers.model.config import ModelConfig
from workers.model.loader import (
    BUNDLED_MODEL_NAME,
    Checkpoint,
    build_model,
    load_checkpoint,
    load_tokenizer,
    parse_dtype,
    resolve_model_path,
    resolve_quantization,
    truncate_layers,
)
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model: str | None = None  # GGUF file, HF folder, or None for the bundled model
    dtype: str = "float32"
    draft_model: str | None = None  # a smaller model with the same tokenizer
    draft_layers: int | None = None  # or: the target's first N layers as the draft model
    eagle_head: str | None = None  # an EAGLE head file; the bundled model has one built in
    device: str = "cpu"  # where the models and KV caches live ("cuda": this process's GPU)
    quantization: str = "none"  # how projection weights are held (loader.QUANTIZATIONS)
    # The device whose kind decides `quantization: auto` (None: `device`): a deployment's
    # verifiers', so that a prefill worker computes the KV cache with the verifiers' weights.
    auto_device: str | None = None

    def load(self, model: str | None, progress: bool = False) -> Checkpoint:
        """The checkpoint of `model` (the target's or a draft model's) as this spec holds it."""
        quantization = resolve_quantization(
            self.quantization, resolve_model_path(model), self.auto_device or self.device
        )
        return load_checkpoint(
            model,
            progress=progress,
            dtype=parse_dtype(self.dtype),
            quantization=quantization,
            device=self.device,
        )


@dataclass(slots=True)
class LoadedEngine:
    engine: LLMEngine
    tokenizer: Tokenizer
    model_name: str
    model_config: ModelConfig  # the whole target's (a tensor-parallel engine holds a slice)


def build_drafters(
    spec: ModelSpec,
    config: EngineConfig,
    target_config: ModelConfig,
    checkpoint: Checkpoint | None,
    target: TransformerLM | None,
    progress: bool = True,
    only: str | None = None,
    skip: Collection[str] = (),
) -> tuple[dict[str, Drafter], dict[str, float]]:
    """Every drafter the settings allow, and each one's seconds per drafted token (model-free
    drafters: 0). What a drafter needs of the target: a draft model from its own file only the
    target's config; the target's first layers its `checkpoint`; EAGLE the `target` model. A
    drafter actor passes None for what it did not load. `only`: just that method, which must
    then be available; `skip`: methods provided elsewhere (a drafter pool), neither built nor
    required. The server's default method must be available unless skipped."""

    def wanted(method: str) -> bool:
        return (only is None or only == method) and method not in skip

    required = only or config.spec.method
    dtype = parse_dtype(spec.dtype)
    ngram = NgramConfig(
        config.spec.ngram_min, config.spec.ngram_max, config.spec.ngram_fallback_tokens
    )
    drafters: dict[str, Drafter] = {}
    seconds: dict[str, float] = {}
    if wanted("ngram"):
        drafters["ngram"] = NgramDrafter(ngram)
    if wanted("suffix"):
        drafters["suffix"] = SuffixDrafter(ngram)
    if wanted("draft_model") and (spec.draft_model or spec.draft_layers):
        if spec.draft_model is not None:
            draft_checkpoint = spec.load(spec.draft_model, progress)
        elif checkpoint is None:
            raise ValueError("a draft model of the target's first layers needs its checkpoint")
        else:
            draft_checkpoint = truncate_layers(checkpoint, spec.draft_layers or 1)
        if draft_checkpoint.config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_checkpoint.config.vocab_size}) differs "
                f"from the target's ({target_config.vocab_size}); they must share a tokenizer"
            )
        draft = build_model(draft_checkpoint, dtype=dtype, device=spec.device)
        del draft_checkpoint
        drafters["draft_model"] = DraftModelDrafter(
            draft,
            num_blocks=config.kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            min_confidence=config.spec.min_draft_confidence,
        )
        seconds["draft_model"] = forward_times(draft, [1], reps=5)[0]
    elif required == "draft_model" and "draft_model" not in skip:
        raise ValueError("spec method draft_model needs --draft-model or --draft-layers")
    head_path = spec.eagle_head or (BUNDLED_HEAD if spec.model is None else None)
    if wanted("eagle") and head_path is not None and Path(head_path).exists():
        if target is None:
            raise ValueError("the eagle drafter needs the target model")
        eagle = EagleDrafter(
            load_head(Path(head_path), target.config),
            target,
            num_blocks=config.kv_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            lookup=ngram if config.spec.eagle_prompt_lookup else None,
            min_confidence=config.spec.min_draft_confidence,
            grammars=None if checkpoint is None else _grammars(checkpoint),
            loop=loop_config(config, target.device),
        )
        eagle.capture()
        drafters["eagle"] = eagle
        # A depth's rows are priced by their measured share on a GPU. On the CPU the share
        # measures ~0.01 of a forward, yet a batch of four EAGLE requests priced by it drafted
        # 0.35 tokens a step and ran at 0.82x of no speculation (per token: 0.06, 0.90x): what
        # else a drafting sequence costs the step there is not in the model yet.
        rows = 4 if target.device.type == "cuda" else 1
        seconds["eagle"] = eagle.token_seconds(rows=rows)
        if config.spec.tree_nodes:
            eagle.measure_tree(config.spec.num_speculative_tokens, config.spec.tree_nodes)
    elif wanted("eagle") and spec.eagle_head is not None:
        raise FileNotFoundError(f"EAGLE head {spec.eagle_head} not found")
    elif required == "eagle" and "eagle" not in skip:
        raise ValueError("spec method eagle needs --eagle-head (built in for the bundled model)")
    if is_user_method(required) and wanted(required):
        tokenizer = load_tokenizer(spec.model) if checkpoint is None else checkpoint.tokenizer
        context = DrafterContext(
            required,
            target_config,
            config.spec.num_speculative_tokens,
            config.max_model_len,
            spec.device,
            tokenizer,
        )
        drafters[required] = load_user_drafter(context)
    return drafters, seconds


def _grammars(checkpoint: Checkpoint) -> Grammars:
    """Structured output's grammars over the checkpoint's tokenizer (for a drafter)."""
    tokenizer = checkpoint.tokenizer
    return Grammars(tokenizer, checkpoint.config.vocab_size, tokenizer.eos_token_ids)


def needs_target(spec: ModelSpec, method: str) -> bool:
    """Whether a drafter of `method` alone (a drafter actor) needs the target's weights (a
    user's drafter gets the target's config and, where loaded, its tokenizer)."""
    return method == "eagle" or (method == "draft_model" and spec.draft_model is None)


def build_engine(
    spec: ModelSpec,
    config: EngineConfig,
    progress: bool = True,
    remote_drafters: dict[str, tuple[Drafter, float]] | None = None,
    build_target: Callable[[Checkpoint, torch.dtype], TransformerLM] | None = None,
) -> LoadedEngine:
    """The engine for `spec`; `remote_drafters` (method -> drafter, its seconds per drafted
    token) stand in for the local drafters of those methods (the Ray runtime's drafter pool);
    `build_target` builds the target from the checkpoint (a tensor-parallel rank's slice, on
    `spec.device`) instead of the whole model. Draft costs reach the engine in one-token target
    forwards."""
    dtype = parse_dtype(spec.dtype)
    checkpoint = spec.load(spec.model, progress)
    if build_target is None:
        target = build_model(checkpoint, dtype=dtype, device=spec.device)
    else:
        target = build_target(checkpoint, dtype)
    remote = remote_drafters or {}
    drafters, draft_seconds = build_drafters(
        spec, config, checkpoint.config, checkpoint, target, progress, skip=tuple(remote)
    )
    for method, (drafter, token_seconds) in remote.items():
        drafters[method], draft_seconds[method] = drafter, token_seconds
    engine = LLMEngine(
        target,
        config,
        tokenizer=checkpoint.tokenizer,
        eos_token_ids=checkpoint.tokenizer.eos_token_ids,
        drafters=drafters,
        draft_seconds=draft_seconds,
        progress=progress,
    )
    return LoadedEngine(
        engine, checkpoint.tokenizer, spec.model or BUNDLED_MODEL_NAME, checkpoint.config
    )
