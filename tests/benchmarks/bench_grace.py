"""Drafters on a Grace CPU: an estimate, not a measurement (no Grace here; tests/arm64 shows our
kernels' outputs there under emulation, which says nothing of speed).

A draft depth of one sequence, or of a few, reads the drafter's weights once, and our kernels
turn each byte read into arithmetic (unpacking blocks, dot products) at a rate per core. So a
depth on a pod of n cores takes the longer of two times: its bytes over the memory bandwidth
(Grace's, `--grace-gbps`: NVIDIA's figure for a GH200's LPDDR5X), and its bytes over n cores'
kernel rate. This script measures the kernels' rate per core here, one thread, for each kind of
weight a drafter holds (bf16, Q8_0, Q4_1), and takes a Neoverse V2 core at `--core-ratio` of it
(four 128-bit vector pipes against this core's two 512-bit ones: half the lanes a cycle). It
gives the bytes of a draft depth of the shipped EAGLE head over the bundled model (as served:
its layer in bf16, its LM head the target's Q8_0 rows of the draft vocabulary) and of an
EAGLE-3 head for Llama-3.1-8B (one layer of its shape, a 32,000-token draft vocabulary; from its
shapes), and how many Grace cores keep DRAFT_DEPTHS depths within the 8B-shaped verifier's
decode step measured on an H200 (docs/benchmarks.md, One GPU): drafting ahead overlaps the
two, so a drafter within the step keeps up.

    python -m tests.benchmarks.bench_grace
"""

from __future__ import annotations

import math

import torch

from kernels.linear import WeightPacks
from kernels.quant import QuantizedWeight, Weight, weight_nbytes
from tests.benchmarks.report import bench_parser, machine_line, median_time, table, write_section

GRACE_GBPS = 500.0  # NVIDIA's figure for a GH200's LPDDR5X (up to 480 GB of it)
GRACE_CORES = 72
CORE_RATIO = 0.5  # a Neoverse V2 core's vector throughput against this machine's core
VERIFY_STEP_8B_MS = 5.19  # the 8B shape's decode step, batch 1, on an H200 (One GPU)
DRAFT_DEPTHS = 4
# An EAGLE-3 head for Llama-3.1-8B: one decoder layer of the target's shape whose attention
# reads [embedding, feature] (twice the hidden size), and an LM head over its draft vocabulary.
HIDDEN, KV, INTER, DRAFT_VOCAB = 4096, 1024, 14336, 32000
HEAD_8B_WEIGHTS = (
    2 * HIDDEN * (HIDDEN + 2 * KV)  # qkv over [embedding, feature]
    + HIDDEN * HIDDEN  # o
    + 3 * HIDDEN * INTER  # gate, up, down
    + DRAFT_VOCAB * HIDDEN  # LM head
)
BITS = {"bf16": 16.0, "q8_0": 8.5, "q4_1": 5.0}


def core_gbps(weights: list[Weight], reps: int) -> float:
    """The rate (GB/s of weights) at which one thread's projections of one bf16 row go through
    `weights` on our kernels (kernels/linear.py, kernels/quant.py: what a drafter calls)."""
    rows = [torch.randn(1, w.shape[1]).bfloat16() for w in weights]
    packs = WeightPacks()

    def step() -> None:
        for i, (x, w) in enumerate(zip(rows, weights, strict=True)):
            packs.linear(str(i), x, w)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            seconds = median_time(step, reps)
    finally:
        torch.set_num_threads(threads)
    return sum(weight_nbytes(w) for w in weights) / seconds / 1e9


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--grace-gbps", type=float, default=GRACE_GBPS)
    parser.add_argument("--core-ratio", type=float, default=CORE_RATIO)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 15

    from workers.eagle.head import BUNDLED_HEAD
    from workers.eagle.layout import load_head
    from workers.model.loader import build_model, load_checkpoint

    checkpoint = load_checkpoint(quantization="gguf")
    model = build_model(checkpoint, dtype=torch.bfloat16)
    head = load_head(BUNDLED_HEAD, model.config, torch.bfloat16)
    head.attach(model)
    layer = head.midlayer
    dense = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
    dense += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    assert isinstance(head.lm_head, QuantizedWeight)
    by_kind: dict[str, list[Weight]] = {"bf16": list(dense)}
    for w in checkpoint.weights.values():
        if isinstance(w, QuantizedWeight) and w.kind in BITS:
            by_kind.setdefault(w.kind, []).append(w)
    rate = {kind: core_gbps(weights, reps) for kind, weights in by_kind.items()}
    grace_rate = {kind: r * args.core_ratio for kind, r in rate.items()}

    # (name, [(kind, bytes)] of a depth)
    lm_head = head.lm_head
    drafters = [
        (
            "EAGLE-3 head, bundled model (bf16 layer, Q8_0 LM head)",
            [("bf16", sum(weight_nbytes(w) for w in dense)), (lm_head.kind, lm_head.nbytes)],
        ),
    ]
    for kind in ("bf16", "q8_0", "q4_1"):
        drafters.append(
            (
                f"EAGLE-3 head, Llama-3.1-8B shape, all {kind}",
                [(kind, HEAD_8B_WEIGHTS * BITS[kind] / 8)],
            )
        )
    budget_ms = VERIFY_STEP_8B_MS / DRAFT_DEPTHS
    rows = []
    for name, parts in drafters:
        total = sum(b for _, b in parts)
        floor_ms = total / (args.grace_gbps * 1e9) * 1e3
        core_ms = sum(b / (grace_rate[k] * 1e9) * 1e3 for k, b in parts)  # one core's time
        fits = math.ceil(core_ms / budget_ms) if floor_ms < budget_ms else None
        rows.append(
            [
                name,
                f"{total / 1e6:,.1f}",
                f"{floor_ms:.2f}",
                f"{core_ms:.1f}",
                f"{math.ceil(core_ms / floor_ms)}",
                f"{int(VERIFY_STEP_8B_MS // floor_ms)}",
                "never" if fits is None else f"{fits}",
            ]
        )
    rates = ", ".join(f"{kind} {r:.1f}" for kind, r in rate.items())
    body = "\n".join(
        [
            "## Drafters on Grace: an estimate (`python -m tests.benchmarks.bench_grace`)",
            "",
            f"Measured here: {machine_line()}. An estimate, not a measurement: there is no "
            "Grace here, and emulation (tests/arm64) shows our kernels' outputs on arm64, not "
            "their speed.",
            "",
            f"- Our kernels' rate for one row on one core here, GB/s of weights: {rates} (the "
            "weights mostly in this machine's last-level cache: the kernels' arithmetic rate, "
            "which one core's memory bandwidth does not bind here). A "
            f"Neoverse V2 core taken at {args.core_ratio:g}x that (four 128-bit vector pipes "
            "against two 512-bit ones).",
            f"- Grace's memory: {args.grace_gbps:.0f} GB/s (NVIDIA's figure for a GH200), "
            f"{GRACE_CORES} cores.",
            f"- A draft depth of one sequence (or a few: the weights are read once for all) "
            f"reads the drafter's weights once. {DRAFT_DEPTHS} depths must fit in the "
            f"8B-shaped verifier's decode step, {VERIFY_STEP_8B_MS} ms on an H200 (One GPU), "
            f"for drafting ahead to keep up: {budget_ms:.2f} ms a depth.",
            "",
            table(
                [
                    "drafter",
                    "MB a depth",
                    "bandwidth floor on Grace, ms",
                    "one Grace core, ms (est.)",
                    "cores to reach the floor (est.)",
                    "depths in the verify step at the floor",
                    f"cores for {DRAFT_DEPTHS} depths in it (est.)",
                ],
                rows,
            ),
        ]
    )
    print(body)
    write_section("grace_estimate", body, args.output)


if __name__ == "__main__":
    main()
