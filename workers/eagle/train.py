"""Train the EAGLE head for the bundled model, reproducibly, on a CPU.

    python -m workers.eagle.train --seed 0              # on the CPU, about an hour on 2 cores
    python -m workers.eagle.train --seed 0 --device cuda  # the same on a GPU, minutes
    python -m workers.eagle.train --seed 0 --device cuda --max-num-seqs 256 --data-only
                                                          # make and cache the data, no training

Makes (or reuses) the training data (workers/eagle/data.py), picks the draft vocabulary, trains
with the head unrolled `--depth` steps (EAGLE-3's training-time test: step 1 reads the target's
fused features, step j > 1 reads the head's own output of step j - 1 and attends to its own
earlier rows exactly as drafting does), and writes the head with its training command, seed and
held-out statistics in the file's metadata, plus a manifest with the file's sha256.

The loss is the cross-entropy of the head's draft distribution against the target's top-k
next-token distribution (soft labels), summed over steps with weight 0.8^(j - 1). The log says,
per step, how often the head's top token is the target's (the greedy acceptance rate of that
draft position given the earlier ones were accepted), and the mean acceptance length at k =
depth that follows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from kernels.quant import QuantizedWeight, Weight
from workers.eagle.data import (
    PROMPT_SOURCES,
    EagleData,
    build_data,
    default_data_path,
    draft_vocabulary,
)
from workers.eagle.head import BUNDLED_HEAD, EagleConfig, EagleHead
from workers.eagle.layout import save_head
from workers.eagle.unroll import Batch, make_batch, unrolled_outputs
from workers.model.loader import build_model, load_checkpoint
from workers.model.transformer import TransformerLM

STEP_WEIGHT = 0.8
TIMED_STEPS = 20  # steps timed before a time budget sizes the run


@dataclass(slots=True)
class StepStats:
    loss: float
    weight: float
    matches: list[torch.Tensor]  # per step [B, T] bool: head's top token == target's
    valid: list[torch.Tensor]  # per step [B, T] bool: rows that count


def as_float(weight: Weight) -> torch.Tensor:
    """A borrowed weight in fp32 for training (dequantized where the target keeps blocks)."""
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.float()


def attach_in_fp32(head: EagleHead, target: TransformerLM) -> torch.Tensor:
    """Put `head` on `target`'s device with the target's embedding and LM head rows in fp32
    (for training or evaluating it); returns the map from target token ids to draft ids (-1
    outside the draft vocabulary)."""
    head.to(target.device)
    head.attach(target)
    head.embed = None if head.embed is None else as_float(head.embed)
    head.lm_head = None if head.lm_head is None else as_float(head.lm_head)
    vocab = head.draft_vocab.cpu()
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.int64)
    to_draft[vocab] = torch.arange(len(vocab))
    return to_draft


def batch_loss(head: EagleHead, batch: Batch, depth: int) -> tuple[torch.Tensor, StepStats]:
    outputs = unrolled_outputs(head, batch.next_tokens, batch.features, depth)
    t = batch.next_tokens.shape[1]
    total = torch.zeros((), device=batch.features.device)
    weight_sum = 0.0
    matches, valid = [], []
    for j, a in enumerate(outputs):
        w = batch.row_weight.clone()
        w[:, : min(j, t)] = 0.0  # no chain starts before row 0
        rows = w > 0  # the LM head is most of the cost: score only rows with a loss
        logq = torch.log_softmax(head.draft_logits(a[rows]).float(), dim=-1)  # [n, V']
        ce = -(logq.gather(-1, batch.label_ids[rows]) * batch.label_probs[rows]).sum(-1)
        step_w = STEP_WEIGHT**j
        total = total + step_w * (ce * w[rows]).sum() / w.sum().clamp(min=1.0)
        weight_sum += step_w
        match = torch.zeros_like(rows)
        match[rows] = (logq.argmax(-1) == batch.label_ids[rows][:, 0]) & (
            batch.label_probs[rows][:, 0] > 0
        )
        matches.append(match.cpu())  # for the acceptance log, which counts on the host
        valid.append((rows & batch.answer_rows).cpu())
    loss = total / weight_sum
    return loss, StepStats(float(loss.detach()), weight_sum, matches, valid)


def acceptance(stats: list[StepStats], depth: int) -> tuple[list[float], float]:
    """Per-position greedy acceptance (given earlier drafts accepted) and the mean acceptance
    length at k = depth, over chains that fit inside the answer."""
    accepted, counted = [0.0] * depth, [0.0] * depth
    lengths: list[torch.Tensor] = []
    for st in stats:
        b, t = st.matches[0].shape
        for j in range(depth):
            accepted[j] += float((st.matches[j] & st.valid[j]).sum())
            counted[j] += float(st.valid[j].sum())
        # Chains starting at row s: position j of the chain is row s + j of step j.
        starts = t - depth + 1
        if starts <= 0:
            continue
        ok = torch.ones(b, starts, dtype=torch.bool)
        run = torch.ones(b, starts)
        length = torch.ones(b, starts)
        for j in range(depth):
            ok &= st.valid[j][:, j : j + starts]
            run = run * st.matches[j][:, j : j + starts].float()
            length += run
        lengths.append(length[ok])
    rates = [a / max(c, 1.0) for a, c in zip(accepted, counted, strict=True)]
    mean_len = float(torch.cat(lengths).mean()) if lengths else 0.0
    return rates, mean_len


def feature_scales(data: EagleData, num_layers: int, rows: int = 4096) -> torch.Tensor:
    """One scale per target layer's block of the features (`[features]`, each block's entries
    the same): the median over evenly spaced rows of that block's RMS. The layers a head reads
    differ in scale by ten times or more (the residual stream grows with depth), and the fc
    sees them raw in the published layout; training divides each block by its scale, so each
    starts on an equal footing under one learning rate, and `fold_feature_scales` moves the
    division into the fc's columns before the head is saved."""
    stride = max(1, data.features.shape[0] // rows)
    sample = data.features[::stride].float()
    blocks = sample.unflatten(-1, (num_layers, -1))  # [rows, layers, hidden]
    rms = blocks.pow(2).mean(-1).sqrt().median(0).values.clamp(min=1e-6)  # [layers]
    return rms.repeat_interleave(blocks.shape[-1])


def fold_feature_scales(head: EagleHead, scales: torch.Tensor) -> None:
    """The head trained on features divided by `scales` made to read them raw: fc(x / s) is
    fc with its columns divided by s, applied to x."""
    with torch.no_grad():
        head.fc.weight.div_(scales.to(head.fc.weight.device, head.fc.weight.dtype))


def scaled(batch: Batch, scales: torch.Tensor) -> Batch:
    batch.features = batch.features.float() / scales.to(batch.features.device)
    return batch


def batches_of(
    data: EagleData, seqs: list[int], max_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Length-bucketed batches of about `max_tokens` padded tokens, in random order."""
    ordered = sorted(seqs, key=lambda s: data.sequence(s).stop - data.sequence(s).start)
    out: list[list[int]] = []
    current: list[int] = []
    for s in ordered:
        length = data.sequence(s).stop - data.sequence(s).start
        if current and length * (len(current) + 1) > max_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def evaluate(
    head: EagleHead,
    data: EagleData,
    batches: list[list[int]],
    to_draft: torch.Tensor,
    depth: int,
    scales: torch.Tensor | None = None,
) -> tuple[float, list[float], float]:
    device = head.fc.weight.device
    head.eval()
    stats = []
    losses = []
    with torch.no_grad():
        for seqs in batches:
            batch = make_batch(data, seqs, to_draft).to(device)
            if scales is not None:
                batch = scaled(batch, scales)
            loss, st = batch_loss(head, batch, depth)
            losses.append(float(loss))
            stats.append(st)
    head.train()
    rates, mean_len = acceptance(stats, depth)
    return sum(losses) / max(len(losses), 1), rates, mean_len


def train(
    target: TransformerLM,
    data: EagleData,
    config: EagleConfig,
    *,
    seed: int,
    epochs: float,
    depth: int,
    lr: float,
    batch_tokens: int,
    log_path: Path | None = None,
    progress: bool = True,
    autocast: bool = True,
    time_budget_s: float | None = None,
) -> tuple[EagleHead, dict[str, object]]:
    """The head trained on `data` for `epochs`; with `time_budget_s`, for fewer steps where the
    first ones, timed, say that many would not fit (the schedule then spans the steps that
    do)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    vocab = draft_vocabulary(data, config.draft_vocab_size)
    head = EagleHead(config, vocab)
    head.init_weights(seed)  # on the host, so a seed gives the same start on any device
    to_draft = attach_in_fp32(head, target)
    coverage = float((to_draft[data.top_ids[:, 0]] >= 0).float().mean())
    scales = feature_scales(data, len(config.target_layers)).to(target.device)

    order = list(range(data.num_sequences))
    rng.shuffle(order)
    num_val = max(1, data.num_sequences // 20)
    val_seqs, train_seqs = order[:num_val], order[num_val:]
    val_batches = batches_of(data, val_seqs, batch_tokens, random.Random(seed))
    per_epoch = len(batches_of(data, train_seqs, batch_tokens, random.Random(seed)))
    total_steps = max(1, int(per_epoch * epochs))
    warmup = min(100, total_steps // 10)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total_steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed below)

    def emit(record: dict[str, object]) -> None:
        line = json.dumps(record)
        if log:
            log.write(line + "\n")
            log.flush()
        if progress:
            tqdm.write(line)

    emit(
        {
            "event": "start",
            "train_seqs": len(train_seqs),
            "val_seqs": len(val_seqs),
            "steps": total_steps,
            "draft_vocab": len(vocab),
            "draft_vocab_coverage": coverage,
        }
    )
    head.train()
    step = 0
    recent: list[StepStats] = []
    start = time.perf_counter()
    bar = tqdm(total=total_steps, desc="train", disable=not progress)
    while step < total_steps:
        for seqs in batches_of(data, train_seqs, batch_tokens, rng):
            if step >= total_steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            batch = scaled(make_batch(data, seqs, to_draft).to(target.device), scales)
            with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, st = batch_loss(head, batch, depth)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            recent.append(st)
            step += 1
            if time_budget_s is not None and step == TIMED_STEPS and total_steps > step:
                per_step = (time.perf_counter() - start) / step
                fits = max(step, int(time_budget_s / per_step))
                if fits < total_steps:
                    total_steps = fits
                    warmup = min(warmup, max(1, total_steps // 10))
                    bar.total = total_steps
                    emit({"event": "budget", "steps": total_steps, "step_s": round(per_step, 4)})
            bar.update(1)
            bar.set_postfix(loss=f"{st.loss:.3f}")
            if step % 50 == 0 or step == total_steps:
                rates, mean_len = acceptance(recent, depth)
                emit(
                    {
                        "event": "train",
                        "step": step,
                        "loss": sum(r.loss for r in recent) / len(recent),
                        "accept": [round(r, 3) for r in rates],
                        "mean_acceptance_length": round(mean_len, 3),
                        "minutes": round((time.perf_counter() - start) / 60, 1),
                    }
                )
                recent = []
            if step % max(1, per_epoch) == 0 or step == total_steps:
                val_loss, rates, mean_len = evaluate(
                    head, data, val_batches, to_draft, depth, scales
                )
                emit(
                    {
                        "event": "val",
                        "step": step,
                        "loss": round(val_loss, 4),
                        "accept": [round(r, 3) for r in rates],
                        "mean_acceptance_length": round(mean_len, 3),
                    }
                )
    bar.close()
    fold_feature_scales(head, scales)
    val_loss, rates, mean_len = evaluate(head, data, val_batches, to_draft, depth)  # raw features
    summary: dict[str, object] = {
        "val_loss": round(val_loss, 4),
        "val_accept": [round(r, 3) for r in rates],
        "val_mean_acceptance_length": round(mean_len, 3),
        "draft_vocab_coverage": round(coverage, 4),
        "steps": total_steps,
        "minutes": round((time.perf_counter() - start) / 60, 1),
    }
    emit({"event": "done", **summary})
    if log:
        log.close()
    return head, summary


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def add_residual_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--norm-before-residual",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the layer's residual is the normed feature (a published head's option), so each "
        "drafting step starts from a stream of one scale; on the bundled model's data it "
        "accepted more at every draft position than the raw feature did",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--depth", type=int, default=4, help="unrolled drafting steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=1024,
        help="padded tokens per step (at equal compute 1024 beat 4096: more, smaller steps)",
    )
    parser.add_argument("--draft-vocab", type=int, default=8192)
    add_residual_option(parser)
    parser.add_argument("--max-answer-tokens", type=int, default=192)
    parser.add_argument(
        "--prompts",
        default=",".join(PROMPT_SOURCES),
        help=f"comma-separated prompt sources, of {', '.join(PROMPT_SOURCES)}",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="use only this many prompts of each source"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the target and the head run (cuda: this process's GPU); the data and the "
        "head file are the same format either way",
    )
    parser.add_argument(
        "--fp32", action="store_true", help="train in fp32 (default: bf16 autocast, ~2x faster)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences the engine batches while it writes the answers (a few hundred on a GPU)",
    )
    parser.add_argument(
        "--data-only", action="store_true", help="make and cache the training data, then stop"
    )
    parser.add_argument("--output", type=Path, default=BUNDLED_HEAD)
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    progress = not args.no_progress

    checkpoint = load_checkpoint()
    target = build_model(checkpoint, dtype=torch.bfloat16, device=args.device)
    config = EagleConfig.for_target(checkpoint.config, draft_vocab_size=args.draft_vocab)
    config = replace(config, norm_before_residual=args.norm_before_residual)

    def source_data(source: str) -> EagleData:
        """One source's data, from the cache or built (and cached unless `--limit`)."""
        data_path = default_data_path(args.seed, args.max_answer_tokens, source)
        if args.limit is None and data_path.exists():
            part = EagleData.load(data_path)
            if part.target_layers != config.target_layers:
                raise SystemExit(f"{data_path} holds other target layers; delete it to rebuild")
            return part
        part = build_data(
            target,
            checkpoint.tokenizer,
            config.target_layers,
            args.seed,
            args.max_answer_tokens,
            args.limit,
            progress,
            source,
            max_num_seqs=args.max_num_seqs,
        )
        if args.limit is None:
            part.save(data_path)
        return part

    if args.data_only:
        for source in args.prompts.split(","):
            part = source_data(source)
            print(f"{source}: {part.num_sequences} sequences, {len(part.token_ids)} positions")
        return
    # The parts live only in this expression: after the join, one copy of the data remains.
    data = EagleData.concat([source_data(source) for source in args.prompts.split(",")])
    # The head borrows the target's embedding and LM head rows, in fp32 for training.
    fp32_target = build_model(checkpoint, dtype=torch.float32, device=args.device)
    head, summary = train(
        fp32_target,
        data,
        config,
        seed=args.seed,
        epochs=args.epochs,
        depth=args.depth,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        log_path=args.log,
        progress=progress,
        autocast=not args.fp32,
    )
    command = "python -m workers.eagle.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    save_head(
        head.to("cpu", torch.bfloat16),
        args.output,
        {"command": command, "seed": str(args.seed), "summary": json.dumps(summary)},
    )
    manifest = {
        "file": args.output.name,
        "sha256": sha256_of(args.output),
        "command": command,
        "summary": summary,
    }
    args.output.with_suffix(".json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
