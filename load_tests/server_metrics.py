"""The server's side of a load level, from the routers' Prometheus `/metrics`: counters read
before and after the level, gauges polled while it runs. Behind a load balancer, give every
replica's metrics URL: counters add up over replicas, gauges are summed at each poll."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# Counters (sample names as exposed) whose growth over a level the report shows.
COUNTERS = {
    "generated": "outrider_generation_tokens_total",
    "drafted": "outrider_spec_draft_tokens_total",
    "accepted": "outrider_spec_accepted_tokens_total",
    "ttft_sum": "outrider_time_to_first_token_seconds_sum",
    "ttft_count": "outrider_time_to_first_token_seconds_count",
}
# Gauges polled during a level: requests in flight on the routers, and per verifier group
# its queue (running + waiting) and share of KV blocks held.
IN_FLIGHT = "outrider_requests_in_flight"
QUEUE = "outrider_verifier_queue_depth"
KV_USAGE = "outrider_verifier_kv_usage"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and sorted labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@dataclass
class ServerView:
    """What the routers reported over one level."""

    requests: dict[str, float] = field(default_factory=dict)  # by outcome
    routed: dict[str, float] = field(default_factory=dict)  # by reason: prefix, load, only
    counters: dict[str, float] = field(default_factory=dict)  # COUNTERS' growth
    max_in_flight: float = 0.0
    max_queue: dict[str, float] = field(default_factory=dict)  # by verifier group
    max_kv_usage: dict[str, float] = field(default_factory=dict)
    polls: int = 0
    failed_polls: int = 0

    @property
    def mean_ttft(self) -> float | None:
        count = self.counters.get("ttft_count", 0.0)
        return self.counters.get("ttft_sum", 0.0) / count if count else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> ServerView:
        return cls(**row)


def growth_by(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """How much a labelled counter grew from `before` to `after`, summed by one label."""
    grown: dict[str, float] = defaultdict(float)
    for (sample, labels), value in after.items():
        if sample == name and (delta := value - before.get((sample, labels), 0.0)):
            grown[dict(labels).get(label, "?")] += delta
    return dict(grown)


def counter_growth(before: Samples, after: Samples) -> dict[str, float]:
    """How much each of COUNTERS grew from `before` to `after`, over all its labels."""
    return {key: total(after, name) - total(before, name) for key, name in COUNTERS.items()}


class MetricsPoller:
    """Polls the metrics URLs every `interval` seconds from `start()` to `stop()`."""

    def __init__(
        self, session: aiohttp.ClientSession, urls: list[str], interval: float = 1.0
    ) -> None:
        self.session, self.urls, self.interval = session, urls, interval
        self._task: asyncio.Task[None] | None = None
        self._before: Samples = {}
        self.view = ServerView()

    async def scrape(self) -> Samples:
        """All replicas' samples, summed by name and labels."""
        merged: Samples = defaultdict(float)
        for url in self.urls:
            async with self.session.get(url) as resp:
                resp.raise_for_status()
                for key, value in parse(await resp.text()).items():
                    merged[key] += value
        return dict(merged)

    async def start(self) -> None:
        try:
            self._before = await self.scrape()
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise RuntimeError(
                f"cannot read the metrics at {', '.join(self.urls)} ({exc}); "
                "give --metrics-url, or --metrics-url none to run without"
            ) from None
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> ServerView:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            after = await self.scrape()
        except (aiohttp.ClientError, OSError, ValueError):
            self.view.failed_polls += 1  # the routers are gone: no growth to report
            return self.view
        self._note(after)
        before, view = self._before, self.view
        view.requests = growth_by(before, after, "outrider_requests_total", "status")
        view.routed = growth_by(before, after, "outrider_routed_total", "reason")
        view.counters = counter_growth(before, after)
        return view

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._note(await self.scrape())
            except (aiohttp.ClientError, OSError, ValueError):
                self.view.failed_polls += 1  # the level goes on; the report shows the gap

    def _note(self, samples: Samples) -> None:
        view = self.view
        view.polls += 1
        view.max_in_flight = max(view.max_in_flight, total(samples, IN_FLIGHT))
        for (name, labels), value in samples.items():
            group = dict(labels).get("group", "")
            if name == QUEUE:
                view.max_queue[group] = max(view.max_queue.get(group, 0.0), value)
            elif name == KV_USAGE:
                view.max_kv_usage[group] = max(view.max_kv_usage.get(group, 0.0), value)
