"""A checkpoint's rotary scaling, read from a Hugging Face config (`rope_scaling` in
transformers 4, `rope_parameters` in 5) and written back, every default resolved at read time
as transformers resolves it (kernels/rotary.py `RopeScaling` holds the result).

| `rope_type` | served as |
| --- | --- |
| default | plain rotary |
| linear | frequencies divided by `factor` |
| llama3 | Llama 3.1's per-frequency blend (3.1, 3.2, 3.3 checkpoints) |
| yarn | YaRN's ramp and attention factor (Qwen's long-context configs, many fine-tunes) |
| dynamic | plain rotary up to `max_position_embeddings` (the context served) |

(dynamic: transformers recomputes the frequencies per forward past that length, which keys
already in a cache cannot follow, so nothing past it is served.)

Anything else (longrope, mrope, ...) is refused at load, naming what is served.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kernels.rotary import RopeScaling

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True, slots=True)
class RopeSettings:
    """What a config's rope fields come to: the base and the scaling."""

    theta: float
    scaling: RopeScaling | None


def read_rope(cfg: dict[str, Any]) -> RopeSettings:
    """From a config.json's fields (either spelling)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    if kind not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: {supported}")
    if kind in ("default", "dynamic"):  # dynamic: plain within max_position_embeddings
        return RopeSettings(theta, None)
    original = int(
        cfg.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or max_positions
    )
    factor = rope.get("factor")
    if kind == "linear":
        return RopeSettings(theta, RopeScaling("linear", factor=float(_needed(factor, kind))))
    if kind == "llama3":
        scaling = RopeScaling(
            "llama3",
            factor=float(_needed(factor, kind)),
            original_max_positions=original,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        )
        return RopeSettings(theta, scaling)
    return RopeSettings(theta, _yarn(rope, factor, original, max_positions))


def _yarn(
    rope: dict[str, Any], factor: float | None, original: int, max_positions: int
) -> RopeScaling:
    factor = float(factor if factor is not None else max_positions / original)
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
        else:
            attention = _mscale(factor)
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_positions=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=float(attention),
    )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _needed(value: Any, kind: str) -> Any:
    if value is None:
        raise ValueError(f"rope scaling {kind} needs a factor")
    return value


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """transformers 5's `rope_parameters` for these settings (read back by `read_rope`)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is None:
        return out
    if scaling.kind == "freq_factors":
        raise ValueError(
            "per-frequency rope factors (a GGUF file's rope_freqs) have no config.json spelling"
        )
    out.update(rope_type=scaling.kind, factor=scaling.factor)
    if scaling.kind == "llama3":
        out.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_positions,
        )
    elif scaling.kind == "yarn":
        out.update(
            original_max_position_embeddings=scaling.original_max_positions,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            truncate=scaling.truncate,
            attention_factor=scaling.attention_factor,
        )
    return out
