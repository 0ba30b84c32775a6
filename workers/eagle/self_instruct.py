"""User turns written by the target itself, for the EAGLE head's training data.

The templated prompts in `prompts.py` cover a few dozen subjects with a dozen phrasings: a head
trained on the answers to them learns those answers well and held-out chat much less well. More
varied prompts come from the target: given its chat template up to the start of a user turn and
nothing else, an instruction-tuned model writes a user's message (the Magpie recipe), and
sampling at temperature 1 gives requests on every kind of subject, some with pasted text or
code. The drafts the head must learn are the target's answers, so prompts that read oddly still
teach it the right thing; only turns cut off by the length limit, mostly non-ASCII ones, repeats
and any close to a held-out prompt are dropped.

    python -m workers.eagle.self_instruct --count 2000 --seed 0

writes `self_instruct_prompts.json` beside this file. The file is shipped: the head's training
data is rebuilt from it, so a rebuild does not depend on this machine's bf16 arithmetic.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from workers.eagle.data import data_engine, prompts_per_chunk
from workers.engine.sampling_params import SamplingParams
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

SELF_INSTRUCT_FILE = Path(__file__).with_name("self_instruct_prompts.json")
MIN_WORDS = 3
MIN_ASCII = 0.95  # share of printable ASCII characters
MAX_HELD_OUT_OVERLAP = 0.5  # word-set Jaccard similarity to any held-out prompt


def user_turn_prefix(tokenizer: Tokenizer) -> str:
    """The chat template's text before a user message's content (system prompt included)."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    return text.split(marker)[0]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def _overlap(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def keep_turn(text: str, finished: bool, held_out: Iterable[str]) -> bool:
    """Whether a sampled user turn goes into the training prompts."""
    if not finished or len(text.split()) < MIN_WORDS:
        return False
    printable = sum(1 for c in text if c.isascii() and (c.isprintable() or c in "\n\t"))
    if printable < MIN_ASCII * len(text):
        return False
    words = _words(text)
    return all(_overlap(words, _words(h)) < MAX_HELD_OUT_OVERLAP for h in held_out)


def sample_user_turns(
    target: TransformerLM,
    tokenizer: Tokenizer,
    count: int,
    seed: int,
    *,
    max_tokens: int = 160,
    chunk: int = 256,
    max_rounds: int = 100,
    max_num_seqs: int = 64,
    progress: bool = True,
    on_chunk: Callable[[list[str]], None] | None = None,
    deadline: float | None = None,
) -> list[str]:
    """`count` distinct user turns sampled from the target (fewer if `max_rounds` chunks of
    samples do not yield enough), in the order they were drawn. Sample i always has seed
    `seed * 1_000_003 + i`, so neither `chunk` nor `max_num_seqs` (how many sequences the
    engine batches: 64 suits a CPU, a few hundred a GPU) changes which turns are drawn.
    `on_chunk` sees the turns so far after each chunk; past `deadline` (`time.monotonic()`) no
    further chunk starts."""
    from workers.eagle.prompts import held_out_prompts

    held_out = [p for prompts in held_out_prompts().values() for p in prompts]
    engine = data_engine(target, tokenizer, 512, max_num_seqs)
    prefix = tokenizer.encode(user_turn_prefix(tokenizer))
    kept: dict[str, None] = {}  # ordered set of normalized turns
    turns: list[str] = []
    bar = tqdm(total=count, desc="user turns", disable=not progress)
    for round_ in range(max_rounds):
        if len(turns) >= count or (round_ and deadline is not None and time.monotonic() > deadline):
            break
        first = seed * 1_000_003 + round_ * chunk  # one sampling seed per draw
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=s)
            for s in range(first, first + chunk)
        ]
        for done in engine.generate([prefix] * chunk, params):
            text = done.text.strip()
            key = " ".join(text.lower().split())
            if key in kept or not keep_turn(text, done.finish_reason == "stop", held_out):
                continue
            kept[key] = None
            turns.append(text)
            bar.update(1)
            if len(turns) == count:
                break
        if on_chunk is not None:
            on_chunk(turns)
    bar.close()
    return turns


def load_self_instruct_prompts(path: Path = SELF_INSTRUCT_FILE) -> list[str]:
    return list(json.loads(path.read_text())["prompts"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the target runs (cuda: a GPU)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences the engine batches (a few hundred on a GPU); the turns drawn are the same",
    )
    parser.add_argument("--output", type=Path, default=SELF_INSTRUCT_FILE)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from workers.model.loader import build_model, load_checkpoint

    checkpoint = load_checkpoint()
    target = build_model(checkpoint, dtype=torch.bfloat16, device=args.device)
    chunk = prompts_per_chunk(args.max_num_seqs)

    def write(turns: list[str]) -> None:
        """The file after every chunk, so a run stopped early leaves what it drew. The first n
        turns are what `--count n` draws, and the command it names says so."""
        options = {"count": len(turns), "seed": args.seed, "max_tokens": args.max_tokens}
        command = "python -m workers.eagle.self_instruct " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in options.items()
        )
        record = {"command": command, "model": checkpoint.config.name, "prompts": turns}
        args.output.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

    turns = sample_user_turns(
        target,
        checkpoint.tokenizer,
        args.count,
        args.seed,
        max_tokens=args.max_tokens,
        chunk=chunk,
        max_rounds=-(-20 * args.count // chunk),  # gives up below a 5% keep rate
        max_num_seqs=args.max_num_seqs,
        on_chunk=write,
    )
    write(turns)
    print(f"{len(turns)} user turns -> {args.output}")


if __name__ == "__main__":
    main()
