"""What a verifier and a drafter running at once cost each other on this machine.

Two Ray actors of one CPU each, as the runtime places a verifier and a drafter: one runs the
target's verify forward (k + 1 new tokens, logits for each) over and over, the other the draft
model's one-token forward. Each is timed alone and with the other running, in interleaved
rounds; the table gives the medians. Both forwards mostly stream weights from memory, so what
they share is the memory bandwidth (and, on a virtual machine, whatever the host puts behind
its two vCPUs). Used by `bench_runtime --pair qwen`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tests.benchmarks.report import table

CONTEXT_TOKENS = 200  # cached before the timed forwards, about a chat prompt's length
BLOCK_SIZE = 16


class ForwardLoop:
    """Ray actor body: one model with a paged cache holding a context, timing forwards."""

    def __init__(self, model: str, new_tokens: int) -> None:
        import torch

        from workers.engine.model_runner import ModelRunner, SeqForward
        from workers.kv_cache import PagedKVCache
        from workers.model.loader import build_model, load_checkpoint

        torch.set_num_threads(1)
        net = build_model(load_checkpoint(model, dtype=torch.bfloat16), dtype=torch.bfloat16)
        num_blocks = -(-(CONTEXT_TOKENS + new_tokens) // BLOCK_SIZE)
        cache = PagedKVCache(net.config, num_blocks, BLOCK_SIZE, net.dtype, net.device)
        self.runner = ModelRunner(net, cache)
        blocks = list(range(num_blocks))
        self.runner.forward([SeqForward(list(range(100, 100 + CONTEXT_TOKENS)), 0, blocks)])
        # The same slots each time: what is timed is the forward, not what it computes.
        self.forward = SeqForward(
            list(range(1000, 1000 + new_tokens)), CONTEXT_TOKENS, blocks, num_logits=new_tokens
        )

    def run(self, seconds: float) -> list[float]:
        """Forward times (s) over about `seconds`."""
        times = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            self.runner.forward([self.forward])
            times.append(time.perf_counter() - start)
        return times


def concurrency_section(
    target: str, draft: str, k: int, rounds: int = 3, seconds: float = 5.0
) -> tuple[str, float]:
    """The table, and how much slower the target's verify forward is beside the drafter (a
    ratio of medians). Starts and stops its own local Ray instance."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(ForwardLoop)
        loops: dict[str, Any] = {
            "target": actor.remote(target, k + 1),
            "draft": actor.remote(draft, 1),
        }
        ray.get([loop.run.remote(0.5) for loop in loops.values()])  # loaded and warm
        alone: dict[str, list[float]] = {name: [] for name in loops}
        together: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(rounds):
            for name, loop in loops.items():
                alone[name] += ray.get(loop.run.remote(seconds))
            both = {name: loop.run.remote(seconds) for name, loop in loops.items()}
            for name, ref in both.items():
                together[name] += ray.get(ref)
    finally:
        ray.shutdown()
    rows = []
    slowdown = {}
    for name, label in (("target", f"target, {k + 1} new tokens"), ("draft", "draft, 1 token")):
        a, b = statistics.median(alone[name]), statistics.median(together[name])
        slowdown[name] = b / a
        rows.append([label, f"{a * 1000:.0f} ms", f"{b * 1000:.0f} ms", f"{b / a:.2f}x"])
    text = table(["forward", "alone", "beside the other's loop", "slower by"], rows)
    return text, slowdown["target"]
