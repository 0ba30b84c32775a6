"""Shared by the runtime tests: prompts, the deployment configs, a way to run them all."""

from __future__ import annotations

from typing import Any

from cluster.actors import info_when_up
from cluster.config import DeploymentConfig, from_dict
from cluster.output_reader import actor_gone
from workers.engine.config import RequestSpec
from workers.engine.sampling_params import SamplingParams

TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def stream_failures() -> tuple[type[BaseException], ...]:
    """What a stream fails with when its verifier dies: the actor's error (the stream's end or
    the channel's keep-alive sees it first), or a ConnectionError where the keep-alive found
    the verifier silent first. The router answers all alike (router/backends.py)."""
    return (*actor_gone(), ConnectionError)


def deployment(
    method: str, drafters: int, prefill: int = 0, tree_nodes: int = 0, **drafter: object
) -> DeploymentConfig:
    """A deployment config for the cluster tests (`tree_nodes`: EAGLE drafts trees)."""
    speculative = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    return from_dict(
        {
            "dtype": "float32",
            "quantization": "none",  # float weights: the fp32 oracle's own tokens
            "speculative": {**speculative, "tree_nodes": tree_nodes},
            "pools": {
                # Remote prefill for every prompt (no length threshold) when there is a worker.
                "prefill": {"replicas": prefill, "min_remote_prompt_tokens": 1},
                "verifier": {"resources": {"cpus": 1}},
                "drafter": {"replicas": drafters, "method": method, **drafter},
            },
            "ray": {"dashboard_port": 8265},
            "telemetry": {"exporter": "memory"},
        }
    )


def run_all(runtime: Any, prompts: list[list[int]], method: str) -> list[list[int]]:
    streams = [runtime.submit(p, GREEDY, RequestSpec(method=method)) for p in prompts]
    return [[t for chunk in s for t in chunk] for s in streams]


def wait_restarted(actor: Any, before: int, timeout_s: float = 180.0) -> None:
    """Wait until Ray has restarted `actor` (its process `before` gone) and it answers."""
    info_when_up(actor, timeout_s, lambda info: bool(info["pid"] != before))
