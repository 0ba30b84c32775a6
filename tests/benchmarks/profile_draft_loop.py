"""Where an EAGLE draft-loop proposal's time goes (on a GPU, its CUDA graphs captured).

    python -m tests.benchmarks.profile_draft_loop [--out DIR] [--device cuda]

The bundled head over a target of its shape with random bf16 weights (timing needs neither
the GGUF nor the target's layers, which never run), each sequence with `--context` rows of
history. For each depth 1..k and batch sizes 1 and 4: the median wall time of a proposal as
the engine makes it (`EagleDrafter.propose`, redoing the last feature row as `token_seconds`
does), and of the graph replay alone; then the kernels of one depth-k replay (torch.profiler):
how many, their GPU time, the costliest first. Prints tables and writes
DIR/draft_loop.json. Free of Ray, Redis and OpenTelemetry imports (the lent GPU machines have
none); on a CPU it runs the loop eagerly, which checks the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.benchmarks.bench_gpu_8b import random_model
from workers.drafting.base import DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.drafting.eagle_loop import EagleDraftLoop, LoopConfig, LoopShape
from workers.eagle.head import BUNDLED_HEAD, EagleHead
from workers.eagle.layout import load_head
from workers.engine.graph_runner import replay_or_run
from workers.engine.sampling_params import SamplingParams
from workers.model.config import ModelConfig


def target_for(head: EagleHead) -> ModelConfig:
    """A target the head fits, of its own width, with as many layers as its deepest fused one
    needs and the target's vocabulary (the loop uses only its embedding and LM head rows)."""
    return replace(
        head.config.layer_config(),
        vocab_size=head.config.vocab_size,
        hidden_size=head.config.target_hidden_size,
        num_layers=max(head.config.target_layers) + 1,
        name="the head's target's shape, random weights",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drafter_with_history(
    device: torch.device, k: int, rows: int, context: int
) -> tuple[EagleDrafter, list[str]]:
    head = load_head(BUNDLED_HEAD)
    target = random_model(target_for(head), device)
    loop = LoopConfig(max_seqs=8, max_depth=k)
    drafter = EagleDrafter(head, target, num_blocks=64 * rows, max_model_len=2048, loop=loop)
    drafter.capture()
    width = len(head.config.target_layers) * head.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(rows)]
    for rid in rids:
        drafter.add(rid, [7] * (context + 1), SamplingParams(temperature=0.0))
        features = torch.randn(context, width, generator=gen).to(device, torch.bfloat16)
        drafter.observe_hidden(rid, 0, features)
    drafter.propose([DraftRequest(rid, context + 1, 1) for rid in rids])  # the history, eagerly
    return drafter, rids


def replay(loop: EagleDraftLoop, shape: LoopShape) -> None:
    """The loop at `shape` on whatever its buffers hold: its graph, or eagerly without one."""
    replay_or_run(loop._graphs, shape, loop._run)


def timings(
    drafter: EagleDrafter, rids: list[str], context: int, depth: int, reps: int
) -> dict[str, float]:
    """Median ms of a proposal of `depth` tokens, and of its replay alone."""
    device = drafter.cache.data.device
    requests = [DraftRequest(rid, context + 1, depth) for rid in rids]
    loop = drafter.loop
    assert loop is not None
    proposals, replays = [], []
    for _ in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        drafter.propose(requests)
        sync(device)
        proposals.append(time.perf_counter() - start)
        shape = loop.shape_for(len(rids), depth)
        start = time.perf_counter()
        replay(loop, shape)
        sync(device)
        replays.append(time.perf_counter() - start)
    return {
        "proposal_ms": 1000 * statistics.median(proposals[2:]),
        "replay_ms": 1000 * statistics.median(replays[2:]),
    }


CATCH_UP_ROWS = (8, 64, 256)


def catch_up_ms(drafter: EagleDrafter, rows: int, reps: int) -> float:
    """Median ms of one sequence's catch-up over `rows` new feature rows (a prompt's, before
    its first loop proposal: EagleDrafter._catch_up), the sequence new each time."""
    device = drafter.cache.data.device
    width = len(drafter.head.config.target_layers) * drafter.head.config.hidden_size
    features = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    features = features.to(device, drafter.cache.data.dtype)
    times = []
    for i in range(reps + 2):
        rid = f"catch-up-{rows}-{i}"
        drafter.add(rid, [7] * (rows + 1), SamplingParams(temperature=0.0))
        drafter.observe_hidden(rid, 0, features)
        sync(device)
        start = time.perf_counter()
        failed = drafter._catch_up([(rid, drafter._seqs[rid])])
        sync(device)
        times.append(time.perf_counter() - start)
        drafter.remove(rid)
        assert not failed, "the head's cache is too small for the catch-up"
    return 1000 * statistics.median(times[2:])


def kernels(drafter: EagleDrafter, num_seqs: int, depth: int) -> dict[str, Any]:
    """The kernels of one replay at this shape: count, GPU ms, the costliest."""
    from torch.profiler import ProfilerActivity, profile

    loop = drafter.loop
    assert loop is not None
    shape = LoopShape(num_seqs, depth)
    device = drafter.cache.data.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        replay(loop, shape)
        sync(device)
    rows = [
        e
        for e in prof.key_averages()
        if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"
    ]
    rows.sort(key=lambda e: -e.device_time_total)
    return {
        "kernels": sum(e.count for e in rows),
        "gpu_ms": sum(e.device_time_total for e in rows) / 1000,
        "top": [[e.key[:60], e.count, round(e.device_time_total, 1)] for e in rows[:15]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict[str, Any] = {"device": str(device), "k": args.k, "context": args.context}
    if device.type == "cuda":
        results["card"] = torch.cuda.get_device_name(device)
        results["date"] = time.strftime("%Y-%m-%d")
    with torch.inference_mode():
        for rows in (1, 4):
            drafter, rids = drafter_with_history(device, args.k, rows, args.context)
            by_depth = {
                str(d): timings(drafter, rids, args.context, d, args.reps)
                for d in range(1, args.k + 1)
            }
            results[f"batch_{rows}"] = by_depth
            print(f"{rows} sequence(s): depth -> proposal ms / replay ms")
            for d, t in by_depth.items():
                print(f"  {d}: {t['proposal_ms']:.3f} / {t['replay_ms']:.3f}")
            if rows == 1:
                results["kernels"] = kernels(drafter, 1, args.k)
                results["catch_up_ms"] = {
                    str(n): catch_up_ms(drafter, n, args.reps) for n in CATCH_UP_ROWS
                }
                print(f"catch-up ms by new rows: {results['catch_up_ms']}")
    print(json.dumps(results.get("kernels", {}), indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_loop.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
