"""Retrain the EAGLE head in one run, within a time budget: one prepared call on a GPU.

    python -m workers.eagle.retrain --device cuda --minutes 9 --out DIR   # a lent H100/H200
    python -m workers.eagle.retrain --quick --out DIR                     # the same path, CPU

Every stage runs in this process on one device, each with its share of `--minutes` (model
loading included), and writes into `--out` only (at most five files, none over 16 MB):
1. user turns sampled from the target itself (self_instruct.py, the Magpie recipe), as many as
   `--turns` or the stage's deadline allows, deduplicated and kept away from held-out prompts;
2. answers from our batched engine to those turns, the templated prompts and the shipped
   self-instruct prompts (greedy and seeded sampled, alternating), until the deadline;
3. the target's features and top-k next tokens at every position (teacher forcing);
4. training with the training-time-test unrolling (train.py `train`), its steps sized to what
   is left of the budget once the first steps have been timed;
5. held-out evaluation: the held-out prompts' greedy answers teacher-forced the same way, and
   the mean acceptance length at k = `--depth` of the new head and of the shipped one on them.

Writes `head.safetensors` (with its command, seed and summary in the metadata), `train.jsonl`
(the training log), `turns.json` (the sampled turns) and `summary.json` (stages, counts,
seconds, both heads' held-out acceptance, and whether the new one is the better). Held-out and
benchmark prompts never enter training. The data follows from the command and its seed; how
much of it a budget reaches depends on the device.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from workers.eagle.data import EagleData, generate_answers, source_prompts, teacher_force
from workers.eagle.head import BUNDLED_HEAD, EagleConfig, EagleHead
from workers.eagle.layout import load_head, save_head
from workers.eagle.prompts import held_out_prompts
from workers.eagle.self_instruct import sample_user_turns
from workers.eagle.train import (
    add_residual_option,
    attach_in_fp32,
    batches_of,
    evaluate,
    train,
)
from workers.model.loader import build_model, load_checkpoint
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

# Each stage's deadline, as a share of the budget from the start: the data's stages first.
DEADLINES = {"turns": 0.12, "answers": 0.32, "features": 0.55, "train": 0.93}
# Tokens a teacher-forcing forward packs: more on a GPU, whose eager forward is host-bound.
TOKENS_PER_FORWARD = {"cpu": 2048, "cuda": 8192}


@dataclass(slots=True)
class Budget:
    """Seconds since the run began, and each stage's deadline in them."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def deadline(self, stage: str) -> float:
        return self.start + DEADLINES[stage] * self.seconds

    def left(self, stage: str) -> float:
        return max(0.0, self.deadline(stage) - time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def held_out_data(
    target: TransformerLM, tokenizer: Tokenizer, layers: tuple[int, ...], args: argparse.Namespace
) -> EagleData:
    """The held-out prompts' greedy answers, teacher-forced as the training data is."""
    prompts = [p for kind in held_out_prompts().values() for p in kind]
    prompts = prompts[:2] if args.quick else prompts
    greedy = generate_answers(
        target, tokenizer, prompts, args.max_answer_tokens, args.seed, False, args.max_num_seqs
    )
    return teacher_force(target, greedy[::2], layers, progress=False)  # the greedy half


def held_out_answers(data: EagleData) -> list[tuple[list[int], list[int]]]:
    """The (prompt, answer) of each held-out sequence, to teacher-force again."""
    out = []
    for s in range(data.num_sequences):
        tokens, prompt = data.token_ids[data.sequence(s)].tolist(), int(data.prompt_lens[s])
        out.append((tokens[:prompt], tokens[prompt:]))
    return out


def acceptance_of(
    head: EagleHead, fp32_target: TransformerLM, data: EagleData, depth: int
) -> float:
    """The head's mean acceptance length at k = `depth` on `data` (greedy, offline)."""
    to_draft = attach_in_fp32(head, fp32_target)
    batches = batches_of(data, list(range(data.num_sequences)), 1024, random.Random(0))
    _, _, mean_len = evaluate(head.float(), data, batches, to_draft, depth)
    return mean_len


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, object]:
    budget = Budget(60 * args.minutes)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    mark = time.monotonic()

    def done(stage: str) -> None:
        nonlocal mark
        now = time.monotonic()
        seconds[stage] = round(now - mark, 1)
        mark = now
        print(f"[retrain] {stage}: {seconds[stage]} s", flush=True)

    checkpoint = load_checkpoint()
    tok = checkpoint.tokenizer
    target = build_model(checkpoint, dtype=torch.bfloat16, device=args.device)
    fp32_target = build_model(checkpoint, dtype=torch.float32, device=args.device)
    config = EagleConfig.for_target(checkpoint.config, draft_vocab_size=args.draft_vocab)
    config = replace(config, norm_before_residual=args.norm_before_residual)
    done("load")

    turns = sample_user_turns(
        target,
        tok,
        args.turns,
        args.seed,
        max_tokens=args.max_turn_tokens,
        chunk=min(256, 4 * args.max_num_seqs),
        max_num_seqs=args.max_num_seqs,
        progress=False,
        deadline=budget.deadline("turns"),
    )
    (out / "turns.json").write_text(json.dumps({"seed": args.seed, "turns": turns}, indent=0))
    done("turns")

    prompts = list(turns)
    for source in ("templates", "self-instruct"):
        prompts += source_prompts(source, args.seed)[: args.limit]
    prompts = list(dict.fromkeys(prompts))  # the same prompt once
    # Seeded order: where the deadline cuts the answers, every source keeps its share.
    random.Random(args.seed).shuffle(prompts)
    answers = generate_answers(
        target,
        tok,
        prompts,
        args.max_answer_tokens,
        args.seed,
        False,
        args.max_num_seqs,
        deadline=budget.deadline("answers"),
    )
    done("answers")
    data = teacher_force(
        target,
        answers,
        config.target_layers,
        progress=False,
        tokens_per_forward=TOKENS_PER_FORWARD.get(torch.device(args.device).type, 2048),
        deadline=budget.deadline("features"),
    )
    done("features")

    head, summary = train(
        fp32_target,
        data,
        config,
        seed=args.seed,
        epochs=args.epochs,
        depth=args.depth,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        log_path=out / "train.jsonl",
        progress=False,
        autocast=args.device != "cpu",
        time_budget_s=budget.left("train"),
    )
    done("train")

    held_out = held_out_data(target, tok, config.target_layers, args)
    new = acceptance_of(head, fp32_target, held_out, args.depth)
    old = load_head(Path(BUNDLED_HEAD), checkpoint.config)
    if old.config.target_layers != config.target_layers:  # the same answers, its own features
        answers = held_out_answers(held_out)
        held_out = teacher_force(target, answers, old.config.target_layers, progress=False)
    shipped = acceptance_of(old, fp32_target, held_out, args.depth)
    done("evaluate")

    command = "python -m workers.eagle.retrain " + shlex.join(argv)
    result: dict[str, object] = {
        "command": command,
        "device": args.device,
        "card": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "seed": args.seed,
        "turns": len(turns),
        "prompts": len(prompts),
        "sequences": data.num_sequences,
        "positions": len(data.token_ids),
        "train": summary,
        "held_out_sequences": held_out.num_sequences,
        "held_out_acceptance": {"new": round(new, 3), "shipped": round(shipped, 3)},
        "better": new > shipped,
        "seconds": seconds,
        "total_seconds": round(budget.elapsed(), 1),
    }
    save_head(
        head.to("cpu", torch.bfloat16),
        out / "head.safetensors",
        {"command": command, "seed": str(args.seed), "summary": json.dumps(result)},
    )
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--minutes", type=float, default=9.0, help="the whole run's budget")
    parser.add_argument("--seed", type=int, default=0)
    add_residual_option(parser)
    parser.add_argument("--turns", type=int, default=20000, help="user turns to sample at most")
    parser.add_argument("--max-turn-tokens", type=int, default=160)
    parser.add_argument("--max-answer-tokens", type=int, default=192)
    parser.add_argument("--limit", type=int, default=None, help="prompts of each shipped source")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch")
    parser.add_argument("--epochs", type=float, default=6.0, help="at most; the budget decides")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="a few prompts and steps on the CPU: checks the path"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.minutes, args.turns, args.limit = "cpu", 3.0, 4, 6
        args.max_turn_tokens, args.max_answer_tokens, args.max_num_seqs = 24, 12, 8
        args.epochs, args.draft_vocab = 1.0, 512
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return run(args, argv)


if __name__ == "__main__":
    main()
