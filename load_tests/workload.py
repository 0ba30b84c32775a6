"""What a load test sends and when: the workload file's requests (or synthetic ones of set
lengths) and the arrival schedules."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "workloads" / "mixed.jsonl"
# What a user says next in a conversation (`--turns`), drawn per turn.
FOLLOW_UPS = (
    "Can you say more about that?",
    "Give me a concrete example.",
    "Summarize that in one sentence.",
    "Why is that?",
    "What should I do first?",
)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of the workload: chat messages (`/v1/chat/completions`), or a raw prompt
    or prompt token ids (`/v1/completions`), with its own token budget when it has one."""

    kind: str
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str | None = None
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    index: int = -1  # its place in the workload (reports count repeated requests by it)

    def __post_init__(self) -> None:
        if [bool(self.messages), self.prompt is not None, bool(self.prompt_ids)].count(True) != 1:
            raise ValueError("a work item has one of messages, a prompt or prompt token ids")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    def follow_up(self, answer: str, question: str) -> WorkItem:
        """The next turn: this conversation, the answer it got, and the user's next question
        (a new input: no workload index)."""
        turns = (*self.messages, ("assistant", answer), ("user", question))
        return WorkItem(self.kind, messages=turns, max_tokens=self.max_tokens)


@dataclass(frozen=True)
class Workload:
    path: Path
    items: list[WorkItem] = field(repr=False)

    @property
    def digest(self) -> str:
        """The file's sha256, first 12 hex digits: reports name what they ran."""
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:12]

    def describe(self, shown_path: str) -> dict[str, Any]:
        """What a report says about it."""
        return {"path": shown_path, "digest": self.digest, "items": len(self.items)}

    def stream(self, seed: int) -> Iterator[WorkItem]:
        """The items in a seeded order, reshuffled each time round, without end."""
        rng = random.Random(seed)
        while True:
            order = list(self.items)
            rng.shuffle(order)
            yield from order


def load_workload(path: str | Path = DEFAULT_WORKLOAD) -> Workload:
    """Read a JSONL workload: one object a line, `{"kind", "messages": [{"role", "content"}]}`
    or `{"kind", "prompt"}`, optionally `"max_tokens"`. Raises ValueError naming the line."""
    path = Path(path)
    items: list[WorkItem] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(_item(json.loads(line), len(items)))
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not items:
        raise ValueError(f"{path}: no requests")
    return Workload(path, items)


def _item(row: dict[str, object], index: int) -> WorkItem:
    messages = row.get("messages") or []
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    pairs = tuple((str(m["role"]), str(m["content"])) for m in messages)
    prompt = row.get("prompt")
    max_tokens = row.get("max_tokens")
    return WorkItem(
        kind=str(row.get("kind", "chat" if pairs else "completion")),
        messages=pairs,
        prompt=None if prompt is None else str(prompt),
        max_tokens=None if max_tokens is None else int(str(max_tokens)),
        index=index,
    )


@dataclass(frozen=True)
class RandomWorkload:
    """Synthetic requests of set lengths, as vLLM's serving benchmark's random dataset makes
    them: `/v1/completions` prompts of random token ids, `input_len` of them, and budgets of
    `output_len` tokens (with `--ignore-eos`, exactly that many), each length drawn uniformly
    within `range_ratio` of its mean. Token ids come from `token_range`, clear of the
    special tokens at the start of common vocabularies and inside every vocabulary of 32,000
    tokens or more. Every request is new: none repeats an earlier one."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0
    token_range: tuple[int, int] = (1000, 32000)

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("random input and output lengths must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("the random range ratio must be in [0, 1)")

    def _length(self, rng: random.Random, mean: int) -> int:
        low = max(1, round(mean * (1 - self.range_ratio)))
        return rng.randint(low, max(low, round(mean * (1 + self.range_ratio))))

    def stream(self, seed: int) -> Iterator[WorkItem]:
        rng = random.Random(seed)
        low, high = self.token_range
        while True:
            ids = tuple(rng.randrange(low, high) for _ in range(self._length(rng, self.input_len)))
            yield WorkItem("random", prompt_ids=ids, max_tokens=self._length(rng, self.output_len))

    def describe(self, shown_path: str) -> dict[str, Any]:
        return {
            "random": {
                "input_len": self.input_len,
                "output_len": self.output_len,
                "range_ratio": self.range_ratio,
                "token_range": list(self.token_range),
            }
        }


def arrival_offsets(rate: float, count: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from the level's start) of `count` requests arriving at `rate` per
    second, the first at 0: a Poisson process (exponential gaps) at burstiness 1, else gamma
    gaps of shape `burstiness` and the same mean, as vLLM's benchmark draws them (below 1
    burstier, above 1 more even)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        if burstiness == 1.0:
            now += rng.expovariate(rate)
        else:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets
