"""What the registry keeps to resume a request on any replica, and the request rebuilt from it.

A request's settings (sampling parameters, speculation, the API's options, its tools) are kept
as JSON beside its prompt (router/state.py, once a prompt however many choices it has); a
resume (`POST /v1/requests/{id}/resume`) serves the same settings over the prompt plus the
tokens the request committed, for the tokens it has left. Greedy requests resume exactly where
they stopped; a seeded one's draws are keyed by position, so it draws what it would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

from router.protocol import GenerateRequest
from router.tools import ToolCalling
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import StructuredOutput


def settings_json(request: GenerateRequest) -> str:
    """What a replica needs besides the prompt to resume `request`."""
    spec = None if request.spec is None else asdict(request.spec)
    return json.dumps(
        {
            "params": asdict(request.params),
            "spec": spec,
            "chat": request.chat,
            "include_usage": request.include_usage,
            "continuous_usage": request.continuous_usage,
            "tokens_as_ids": request.tokens_as_ids,
            "tools": None if request.tools is None else asdict(request.tools),
            "store": request.store,
            "cache_salt": request.cache_salt,
        }
    )


def resumed_request(
    settings: dict[str, Any],
    choice: int,
    prompt_ids: list[int],
    committed: list[int],
    stream: bool,
) -> GenerateRequest | None:
    """Choice `choice` of a request (`settings` from `settings_json`) going on after its
    `committed` tokens; None when it has no tokens left to generate."""
    raw = settings["params"]
    if raw.get("seed") is not None:  # choice k of a seeded request: seed + k
        raw = {**raw, "seed": raw["seed"] + choice}
    structured = raw.get("structured")
    if structured is not None:  # the grammar reads the answer so far first
        structured = StructuredOutput(structured["grammar"], (*structured["committed"], *committed))
    params = SamplingParams(
        **{
            **raw,
            "stop": tuple(raw["stop"]),
            "stop_token_ids": tuple(raw["stop_token_ids"]),
            "logit_bias": tuple((t, b) for t, b in raw.get("logit_bias", ())),
            "allowed_token_ids": tuple(raw.get("allowed_token_ids", ())),
            "bad_words": tuple(tuple(word) for word in raw.get("bad_words", ())),
            "prediction": tuple(raw.get("prediction", ())),
            # The committed tokens are part of the resumed prompt now.
            "min_tokens": max(0, raw.get("min_tokens", 0) - len(committed)),
            "structured": structured,
        }
    )
    left = params.max_tokens - len(committed)
    if left < 1:
        return None
    spec = None if settings["spec"] is None else RequestSpec(**settings["spec"])
    resumed = GenerateRequest(
        [*prompt_ids, *committed],
        replace(params, max_tokens=left),
        spec,
        stream,
        settings["include_usage"],
        settings["chat"],
        continuous_usage=settings.get("continuous_usage", False),
        tokens_as_ids=settings.get("tokens_as_ids", False),
        resumed_tokens=len(committed),
        store=settings.get("store", True),
        cache_salt=settings.get("cache_salt"),
    )
    if tools := settings.get("tools"):  # the answer's tool calls are read as they were
        calling = ToolCalling(tuple(tools["names"]), tools["named"], tools.get("forced", False))
        resumed = replace(resumed, tools=calling)
    return resumed
