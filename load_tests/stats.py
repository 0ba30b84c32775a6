"""Summaries of a load level's requests: throughput, latency percentiles, refusals, goodput."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from load_tests.clients import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Slo:
    """A request counts towards goodput when it succeeds within both bounds (seconds)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft is None:
            return False
        if self.ttft_s is not None and record.ttft > self.ttft_s:
            return False
        tpot = time_per_output_token(record)
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def time_per_output_token(record: RequestRecord) -> float | None:
    """Seconds per token after the first: (latency - ttft) / (tokens - 1)."""
    if record.ttft is None or record.latency is None or record.output_tokens < 2:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def inter_chunk_gaps(record: RequestRecord) -> list[float]:
    """Seconds between consecutive streamed pieces (a piece can carry several tokens: a verify
    step commits its accepted drafts at once)."""
    return [b - a for a, b in itertools.pairwise(record.chunks)]


@dataclass
class LevelSummary:
    level: str
    sent: int
    ok: int
    refused: dict[str, int] = field(default_factory=dict)  # by status: "429", "timeout", ...
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)  # "p50" ... over ok requests
    tpot_s: dict[str, float] = field(default_factory=dict)
    itl_s: dict[str, float] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    mean_acceptance_length: float | None = None
    goodput_per_s: float | None = None
    repeats: int = 0  # requests whose workload item an earlier request of the run sent

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> LevelSummary:
        return cls(**row)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in PERCENTILES} if values else {}


def summarize(
    level: str, records: Sequence[RequestRecord], slo: Slo | None = None, repeats: int = 0
) -> LevelSummary:
    """One level's summary. Its duration runs from the first request's send to the last one's
    end, so rates count the whole level, refused requests' time included. `repeats`: how many
    of its requests repeat an earlier one's input (prefix caches and the shared n-gram pool
    make those cheaper)."""
    ok = [r for r in records if r.ok]
    ends = [r.start + (r.latency or 0.0) for r in records]
    duration = max(ends) - min(r.start for r in records) if records else 0.0
    per_s = 1 / duration if duration > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    steps = sum(r.verify_steps for r in ok)
    tpots = [t for r in ok if (t := time_per_output_token(r)) is not None]
    return LevelSummary(
        level=level,
        sent=len(records),
        ok=len(ok),
        refused=dict(Counter(r.status for r in records if not r.ok)),
        duration_s=duration,
        requests_per_s=len(ok) * per_s,
        output_tokens_per_s=output_tokens * per_s,
        output_tokens=output_tokens,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        ttft_s=_spread([r.ttft for r in ok if r.ttft is not None]),
        tpot_s=_spread(tpots),
        itl_s=_spread([gap for r in ok for gap in inter_chunk_gaps(r)]),
        latency_s=_spread([r.latency for r in ok if r.latency is not None]),
        mean_acceptance_length=((sum(r.accepted for r in ok) + steps) / steps if steps else None),
        goodput_per_s=(None if slo is None else sum(slo.met(r) for r in records) * per_s),
        repeats=repeats,
    )
