"""EAGLE head vs the other drafters on held-out prompts (never used in training).

    python -m tests.benchmarks.bench_eagle [--runs 3] [--max-tokens 128]

Single stream, bf16, greedy, chat template. Every drafter runs at a fixed k = 4 (the acceptance
numbers the issue asks for) and, for EAGLE and n-gram, with adaptive k; EAGLE also as `outrider
serve` runs it (adaptive k, drafts ended where the head doubts them). EAGLE runs as served
(prompt lookup first where the text repeats) and with its head alone. Per prompt kind (chat,
code, summary) the tokens of all that kind's prompts are pooled. Writes the `bench_eagle`
section of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.linear import linear
from tests.benchmarks.report import bench_args, bench_parser, machine_line, table, write_section
from workers.drafting.base import Drafter
from workers.drafting.draft_model import DraftModelDrafter
from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.eagle.data import teacher_force
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import head_metadata, load_head
from workers.eagle.prompts import held_out_prompts
from workers.eagle.trees import acceptance_ranks, best_tree, chain, level_widths, walk
from workers.engine.calibration import (
    DraftCosts,
    forward_times,
    relative_token_cost,
    verify_costs,
)
from workers.engine.config import (
    DEFAULT_MIN_DRAFT_CONFIDENCE,
    EngineConfig,
    RequestSpec,
    SpecConfig,
)
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import Completion
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import Checkpoint, build_model, load_checkpoint, truncate_layers
from workers.model.transformer import TransformerLM

K = 4
DRAFT_LAYERS = 12
SERVED = DEFAULT_MIN_DRAFT_CONFIDENCE  # what `outrider serve` ends a model draft at
TREE_NODES = 16
# (label, method, adaptive k, EAGLE's prompt lookup first, the head's min draft confidence,
# the most nodes of a draft tree: 0 for chains)
CONFIGS = [
    ("none", "none", False, True, 0.0, 0),
    ("ngram, k=4", "ngram", False, True, 0.0, 0),
    ("draft_model (12 layers), k=4", "draft_model", False, True, 0.0, 0),
    ("eagle, k=4", "eagle", False, True, 0.0, 0),
    ("eagle head only, k=4", "eagle", False, False, 0.0, 0),
    (f"eagle trees of {TREE_NODES}, depth 4", "eagle", False, True, 0.0, TREE_NODES),
    ("ngram, adaptive", "ngram", True, True, 0.0, 0),
    ("eagle, adaptive, whole drafts", "eagle", True, True, 0.0, 0),
    ("eagle, adaptive", "eagle", True, True, SERVED, 0),
    (f"eagle, adaptive, trees of {TREE_NODES}", "eagle", True, True, SERVED, TREE_NODES),
]


@dataclass(slots=True)
class Result:
    seconds: float
    completions: list[Completion]

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


def engine_for(
    target,
    drafters: dict[str, Drafter],
    costs: DraftCosts,
    adaptive: bool,  # type: ignore[no-untyped-def]
    verify: tuple[float, ...],
    tokenizer,
    tree_nodes: int,
) -> LLMEngine:
    spec = SpecConfig(
        num_speculative_tokens=K, adaptive=adaptive, verify_costs=verify, tree_nodes=tree_nodes
    )
    config = EngineConfig(
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, spec=spec
    )
    return LLMEngine(
        target,
        config,
        tokenizer=tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
        drafters=drafters,
        draft_costs=costs,
    )


def run_one(engine: LLMEngine, prompts: list[list[int]], method: str, max_tokens: int) -> Result:
    """Each prompt alone (single stream), one after the other."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    spec = RequestSpec(enabled=method != "none", method=None if method == "none" else method)
    completions, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        completions += engine.generate([prompt], params, spec)
        seconds += time.perf_counter() - start
    return Result(seconds, completions)


def paired_ratio(results: list[Result], base: list[Result]) -> float:
    """Median over rounds of tokens/s against `base`'s in the same round."""
    return statistics.median(
        (r.tokens / r.seconds) / (b.tokens / b.seconds) for r, b in zip(results, base, strict=True)
    )


def stats(results: list[Result]) -> tuple[float, float, list[float]]:
    """(mean acceptance length, drafts per verify step, acceptance by draft position)."""
    accepted = drafted = steps = 0
    by_pos = [0] * K
    reached = [0] * K
    for r in results:
        for c in r.completions:
            accepted += c.spec.accepted
            drafted += c.spec.drafted
            steps += c.spec.verify_steps
            for i, (acc, drf) in enumerate(
                zip(c.spec.accepted_per_position, c.spec.drafted_per_position, strict=False)
            ):
                if i < K:
                    by_pos[i] += acc
                    reached[i] += drf
    if not steps:
        return 1.0, 0.0, []
    return (
        (accepted + steps) / steps,
        drafted / steps,
        [a / n if n else 0.0 for a, n in zip(by_pos, reached, strict=True)],
    )


TREE_DEPTH = 6  # unrolled steps the tree analysis looks at
TREE_SIZES = (8, 16, 32)


def tree_section(
    checkpoint: Checkpoint,
    target: TransformerLM,  # bf16, the benchmark's
    head_path: Path,
    answers: dict[str, list[tuple[list[int], list[int]]]],
    eagle_cost: float,
    reps: int,
) -> str:
    """Offline acceptance of static draft trees on the held-out answers (workers/eagle/trees.py),
    with each prompt's tree shaped by the other prompts, and the cost such a step would have."""
    target32 = build_model(checkpoint, dtype=torch.float32)
    head = load_head(head_path)
    head.attach(target32)
    head.eval()
    vocab = checkpoint.config.vocab_size
    ranks: list[tuple[str, torch.Tensor]] = []  # (kind, chains of one prompt)
    for kind, pairs in answers.items():
        data = teacher_force(target, pairs, head.config.target_layers, progress=False)
        ranks += [(kind, r) for r in acceptance_ranks(head, data, TREE_DEPTH, vocab)]
    kinds = list(answers)
    trees = {"chain, k = 4": chain(4)} | {
        f"best tree of {n}": best_tree(torch.cat([r for _, r in ranks]), n) for n in TREE_SIZES
    }
    counts = sorted({1} | {len(t) + 1 for t in trees.values()})
    with torch.inference_mode():
        verify = dict(zip(counts, forward_times(target, counts, reps), strict=True))
        assert head.lm_head is not None
        lm_head = head.lm_head.to(torch.bfloat16)
        widths = sorted({1} | {w for t in trees.values() for w in level_widths(t)})
        lm_s = {w: lm_head_seconds(lm_head, w, reps) for w in widths}
    table_rows = []
    for name, tree in trees.items():
        lengths = {}
        for kind in kinds:  # leave one prompt out: its tree comes from the others' chains
            tokens = steps = 0
            for i, (k, r) in enumerate(ranks):
                if k != kind or not len(r):
                    continue
                shape = tree
                if not name.startswith("chain"):
                    others = torch.cat([o for j, (_, o) in enumerate(ranks) if j != i])
                    shape = best_tree(others, len(tree))
                t, n = walk(shape, r)
                tokens, steps = tokens + t, steps + n
            lengths[kind] = tokens / max(steps, 1)
        verify_cost = verify[len(tree) + 1] / verify[1]
        draft_cost = sum(eagle_cost * lm_s[w] / lm_s[1] for w in level_widths(tree))
        table_rows.append(
            [
                name,
                "-".join(str(w) for w in level_widths(tree)),
                *(f"{lengths[k]:.2f}" for k in kinds),
                f"{verify_cost:.2f}",
                f"{draft_cost:.2f}",
                *(f"{lengths[k] / (verify_cost + draft_cost):.2f}x" for k in kinds),
            ]
        )
    return table(
        [
            "draft",
            "nodes per depth",
            *(f"{k} acceptance length" for k in kinds),
            "verify cost",
            "draft cost",
            *(f"{k} ideal vs none" for k in kinds),
        ],
        table_rows,
    )


TREE_SHAPES = ((4, 0), (6, 0), (4, 16), (6, 16), (6, 32), (8, 32), (8, 48))  # (k, nodes)


def shapes_section(
    target: TransformerLM,
    head_path: Path,
    prompts: dict[str, list[list[int]]],
    tokenizer: Any,
    max_tokens: int,
    quick: bool,
) -> str:
    """Acceptance of whole chains (nodes 0) and trees of each (depth, node budget)."""
    head = load_head(head_path)
    rows = []
    for k, nodes in TREE_SHAPES[:3] if quick else TREE_SHAPES:
        spec = SpecConfig(
            method="eagle",
            num_speculative_tokens=k,
            adaptive=False,
            disable_batch_size=64,
            tree_nodes=nodes,
            verify_costs=(1.0,) * 64,  # nothing cut
            eagle_prompt_lookup=False,
            min_draft_confidence=0.0,
        )
        drafter = EagleDrafter(head, target, num_blocks=1024, max_model_len=1024)
        engine = LLMEngine(
            target,
            EngineConfig(max_model_len=1024, spec=spec),
            eos_token_ids=tokenizer.eos_token_ids,
            drafters={"eagle": drafter},
        )
        row: list[str] = [str(k), str(nodes) if nodes else "chain"]
        for ids in prompts.values():
            done = [run_one(engine, [p], "eagle", max_tokens).completions[0] for p in ids]
            steps = sum(c.spec.verify_steps for c in done)
            row.append(f"{(sum(c.spec.accepted for c in done) + steps) / max(steps, 1):.2f}")
        rows.append(row)
    return table(["depth (k)", "nodes", *prompts], rows)


def lm_head_seconds(lm_head: torch.Tensor, rows: int, reps: int) -> float:
    """Median time of the draft-vocabulary logits for `rows` rows (bf16)."""
    x = torch.randn(rows, lm_head.shape[1], dtype=lm_head.dtype)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        linear(x, lm_head)  # what the head uses (a GEMV for one row)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--head", type=Path, default=BUNDLED_HEAD)
    args = bench_args(parser)
    checkpoint = load_checkpoint()
    tok = checkpoint.tokenizer
    target = build_model(checkpoint, dtype=torch.bfloat16)
    draft = build_model(truncate_layers(checkpoint, DRAFT_LAYERS), dtype=torch.bfloat16)
    with torch.inference_mode():
        # [n - 1]: a forward over n tokens (k drafts: n = k + 1; a tree of 16 nodes: 17)
        verify = verify_costs(target, TREE_NODES + 1, reps=5 if args.quick else 20)
        one_token_s = forward_times(target, [1], reps=5 if args.quick else 20)[0]
    eagles = {
        (lookup, confidence): EagleDrafter(
            load_head(args.head),
            target,
            num_blocks=512,
            max_model_len=1024,
            lookup=NgramConfig() if lookup else None,
            min_confidence=confidence,
        )
        for _, _, _, lookup, confidence, _ in CONFIGS
    }
    eagle = eagles[True, SERVED]
    eagle_cost = eagle.token_seconds(reps=5 if args.quick else 30) / one_token_s
    others: dict[str, Drafter] = {
        "ngram": NgramDrafter(NgramConfig()),
        "draft_model": DraftModelDrafter(draft, num_blocks=512, max_model_len=1024),
    }
    tree_cost = eagle.measure_tree(K, TREE_NODES, reps=5 if args.quick else 20) / one_token_s
    costs = DraftCosts(
        {"draft_model": relative_token_cost(draft, target), "eagle": eagle_cost},
        trees={"eagle": tree_cost},
    )
    engines = {
        (adaptive, lookup, confidence, nodes): engine_for(
            target,
            others | {"eagle": eagles[lookup, confidence]},
            costs,
            adaptive,
            verify,
            tok,
            nodes,
        )
        for _, _, adaptive, lookup, confidence, nodes in CONFIGS
    }
    prompts = {
        kind: [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ps]
        for kind, ps in held_out_prompts().items()
    }
    if args.quick:
        prompts = {kind: ps[:1] for kind, ps in prompts.items()}
    rows, goals = [], {}
    answers: dict[str, list[tuple[list[int], list[int]]]] = {}
    with torch.inference_mode():
        for kind, ids in prompts.items():
            results: dict[str, list[Result]] = {label: [] for label, *_ in CONFIGS}
            for round_ in range(args.runs + 1):  # round 0 warms up
                # Prompt by prompt, every drafter in turn: the runs a round's ratios compare
                # are seconds apart, so a slow spell of the machine slows both sides alike.
                round_results = {label: Result(0.0, []) for label, *_ in CONFIGS}
                for prompt in ids:
                    for label, method, *engine_key in CONFIGS:
                        engine = engines[tuple(engine_key)]
                        one = run_one(engine, [prompt], method, args.max_tokens)
                        round_results[label].seconds += one.seconds
                        round_results[label].completions += one.completions
                if round_:
                    for label, result in round_results.items():
                        results[label].append(result)
                print(f"[bench_eagle] {kind}: round {round_}/{args.runs}", file=sys.stderr)
            answers[kind] = [
                (c.prompt_token_ids, c.token_ids) for c in results["none"][0].completions
            ]
            for label, method, *_ in CONFIGS:
                tps = statistics.median(r.tokens / r.seconds for r in results[label])
                vs_none = paired_ratio(results[label], results["none"])
                length, per_step, by_pos = stats(results[label])
                goals[(kind, label)] = (vs_none, length)
                rows.append(
                    [
                        kind,
                        label,
                        f"{tps:.1f}",
                        f"{vs_none:.2f}x",
                        "" if method == "none" else f"{length:.2f}",
                        "" if method == "none" else f"{per_step:.2f}",
                        " / ".join(f"{a:.2f}" for a in by_pos),
                    ]
                )
    trees = tree_section(
        checkpoint, target, args.head, answers, eagle_cost, reps=3 if args.quick else 20
    )
    shapes = shapes_section(target, args.head, prompts, tok, args.max_tokens, args.quick)
    meta = head_metadata(args.head)
    lengths = [goals[(kind, "eagle, k=4")][1] for kind in prompts]
    goal_rows = [
        [
            "eagle mean acceptance length at k = 4 (worst kind)",
            ">= 2.5",
            f"{min(lengths):.2f}",
        ],
        [
            "eagle tokens/s vs none on chat (best of fixed k = 4 and adaptive)",
            ">= 1.8x",
            f"{max(goals[('chat', 'eagle, k=4')][0], goals[('chat', 'eagle, adaptive')][0]):.2f}x",
        ],
    ]
    body = "\n\n".join(
        [
            "## EAGLE draft head\n\n`python -m tests.benchmarks.bench_eagle`",
            f"Machine: {machine_line()}. Bundled SmolLM2-135M-Instruct, bf16, greedy, chat "
            f"template, up to {args.max_tokens} new tokens, one request at a time, medians of "
            f"{args.runs} rounds; in a round each prompt runs with every drafter in turn, and "
            "`vs none` is the median over rounds of a round's tokens/s against `none`'s in that "
            "round. Held-out prompts (workers/eagle/prompts.py "
            f"`HELD_OUT`): {', '.join(f'{len(v)} {k}' for k, v in prompts.items())}.",
            f"Head: `{args.head.name}`, made by `{meta.get('command', '?')}`. Drafting one token "
            f"costs {eagle_cost:.3f} target forwards (one-row head forward plus its "
            f"{eagle.head.config.draft_vocab_size}-token LM head); a 12-layer draft model token "
            f"costs {costs.tokens['draft_model']:.2f}; verifying 4 drafts costs {verify[K]:.2f}, "
            f"{TREE_NODES} tree nodes {verify[TREE_NODES]:.2f}; drafting a tree of {TREE_NODES} "
            f"nodes (depth {K}) costs {tree_cost:.2f}.",
            "### Goals",
            table(["goal", "target", "measured"], goal_rows),
            "### Results",
            "`eagle` is the drafter as `outrider serve` runs it: prompt lookup (n-gram 2..4) "
            "first where the text repeats, the head elsewhere; `eagle head only` drafts with the "
            "head at every step. A model drafter's draft ends where its own probability of the "
            f"draft so far falls below `min_draft_confidence` ({SERVED} as served; the rows at "
            "k = 4 and `whole drafts` draft all k). `eagle trees` draft EAGLE-2 trees of up to "
            f"{TREE_NODES} nodes (docs/design.md, Draft trees): at fixed depth 4 whole, and "
            "adaptive as the speculator prices them (a tree where it pays more than the chain, "
            "cut to the nodes that pay at the verify costs); for them `drafts/step` counts the "
            "depth. `acceptance by position`: of the steps that "
            "drafted an i-th token, the share in which it was accepted (so every draft before it "
            "was accepted too).",
            table(
                [
                    "prompts",
                    "drafter",
                    "tokens/s",
                    "vs none",
                    "mean acceptance length",
                    "drafts/step",
                    "acceptance by position",
                ],
                rows,
            ),
            "### Draft trees by shape",
            "Mean acceptance length (tokens a step) of EAGLE's own trees (the engine's, drafted "
            "and verified: docs/design.md, Draft trees) by depth and node budget, every tree "
            "kept whole, the head alone (no prompt lookup), greedy, the held-out prompts once "
            "each. Acceptance does not depend on the device (what a step costs does): this "
            "is what a GPU's trees of each shape accept too.",
            shapes,
            "### Draft trees (offline)",
            "Would verifying a tree of drafts in one forward pay? Along an accepted path the head "
            "reads the target's own tokens, so a tree's greedy acceptance follows from the rank "
            "of the target's token among the head's drafts at each step (workers/eagle/trees.py). "
            "Measured on the greedy answers of the `none` runs above, stepping through each "
            "answer as the engine does (a step starts where the last one's accepted drafts "
            "ended; averaging over every start instead overstates it, as steps start right after "
            "a miss); each prompt's tree is the most travelled rank paths of the other prompts "
            "(leave one out). `verify cost`: a "
            "forward over the tree's nodes + 1 tokens in one-token forwards (a causal forward: "
            "what a tree mask adds is not measured); `draft cost`: one head forward per depth, "
            "scaled by its LM head's cost at that width; `ideal`: acceptance length over the "
            "two. The engine's own trees, drafted and verified, are the `eagle trees` rows above.",
            trees,
        ]
    )
    print(body)
    write_section("bench_eagle", body, args.output)
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
