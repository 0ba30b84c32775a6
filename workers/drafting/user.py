"""Drafters users bring: a `Drafter` subclass (workers/drafting/base.py) named by its import path,
`package.module:Class`, as the server's method (`--spec-method`, the config's
`speculative.method` or `pools.drafter.method`) or a request's (`"speculative": {"method":
...}`). It is loaded where a built-in drafter would be: in the engine's process, or in the
drafter pool's actors when it is the pool's method (its module must be importable there too).

The class is built with one argument, a `DrafterContext` (plain data: the target's shape, its
tokenizer, the engine's k and context), and then serves under its
method string. Everything it is asked and answers is plain data (the `Drafter` boundary), so
the engine treats it as any other drafter: its drafts are verified by rejection sampling (a
draft with no q is taken as deterministic), so a drafter can slow speculation down but never
change the output, and one that raises means no drafts for its requests, which go on without
speculation (workers/engine/speculator.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from workers.drafting.base import Drafter
from workers.engine.config import is_user_method
from workers.model.config import ModelConfig
from workers.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class DrafterContext:
    """What a user's drafter class is built with."""

    method: str  # the `package.module:Class` it serves under
    target: ModelConfig  # the target's shape: vocab_size, num_layers, hidden_size, ...
    num_speculative_tokens: int  # the engine's k: the most a proposal is asked for
    max_model_len: int
    device: str  # where the engine runs ("cpu", "cuda")
    tokenizer: Tokenizer  # the target's


def load_user_drafter(context: DrafterContext) -> Drafter:
    """The drafter `context.method` names, built; a clear error where it cannot be."""
    method = context.method
    if not is_user_method(method):
        raise ValueError(f"{method!r} is not a drafter class (package.module:Class)")
    module_name, _, class_name = method.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"drafter {method}: cannot import {module_name} ({exc})") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise ValueError(
            f"drafter {method}: {class_name} in {module_name} is not a subclass of "
            "workers.drafting.base.Drafter"
        )
    drafter: Drafter = cls(context)  # type: ignore[call-arg]  # a user's class takes it
    drafter.method = method
    bad = [i for i in drafter.hidden_layers if not 0 <= i < context.target.num_layers]
    if bad:
        raise ValueError(
            f"drafter {method} reads target layers {bad}; the target has "
            f"{context.target.num_layers}"
        )
    return drafter
