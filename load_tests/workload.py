"""What a load test sends and when: the workload file's requests and the arrival schedules."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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
    """One request of the workload: chat messages (`/v1/chat/completions`) or a raw prompt
    (`/v1/completions`), with its own token budget when the file gives one."""

    kind: str
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str | None = None
    max_tokens: int | None = None
    index: int = -1  # its place in the workload (reports count repeated requests by it)

    def __post_init__(self) -> None:
        if bool(self.messages) == (self.prompt is not None):
            raise ValueError("a work item has either messages or a prompt")
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


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """Send times (seconds from the level's start) of `count` requests arriving as a Poisson
    process of `rate` per second: exponential gaps, the first request at 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets
