"""The shared n-gram pool's transport: finished sequences in a Redis stream.

Router replicas append each finished request's tokens (prompt + output) to the stream
`outrider:ngram` (capped, oldest trimmed); every engine with an `ngram` drafter follows the
stream on a daemon thread and feeds what it reads into its `SharedNgramPool`. So a request can
draft from what any earlier request, served by any verifier group through any replica, produced.
The pool only proposes drafts: verification keeps the output exactly the target's whatever it
holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from workers.drafting.ngram import SharedNgramPool

log = logging.getLogger(__name__)

STREAM = "outrider:ngram"
MAX_SEQUENCES = 10_000  # the stream keeps about this many recent sequences
MAX_TOKENS = 4096  # longest sequence shared
STREAM_TTL_S = 3600  # the stream goes an hour after the last sequence was shared


def encode(tokens: Sequence[int], last: int | None = MAX_TOKENS) -> bytes:
    """Token ids as little-endian uint32s: the `last` of them (None: all)."""
    kept = list(tokens) if last is None else list(tokens)[-last:]
    return np.asarray(kept, dtype="<u4").tobytes()


def decode(payload: bytes) -> list[int]:
    return np.frombuffer(payload, dtype="<u4").astype(np.int64).tolist()


async def publish(client: Any, tokens: Sequence[int]) -> None:
    """Append one finished sequence (asyncio client: the router)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.xadd(STREAM, {"tokens": encode(tokens)}, maxlen=MAX_SEQUENCES, approximate=True)
        pipe.expire(STREAM, STREAM_TTL_S)
        await pipe.execute()


def follow(drafters: dict[str, Any], url: str | None, password: str | None) -> PoolFollower | None:
    """Give the `ngram` drafter among `drafters` a pool fed from Redis at `url`; None when there
    is no such drafter or no Redis."""
    drafter = drafters.get("ngram")
    if drafter is None or url is None:
        return None
    pool = SharedNgramPool()
    drafter.pool = pool
    return PoolFollower(url, password, pool).start()


class PoolFollower:
    """Reads the stream into `pool` from its oldest kept entry on, then as entries arrive."""

    def __init__(self, url: str, password: str | None, pool: SharedNgramPool) -> None:
        self.url, self.password, self.pool = url, password, pool
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ngram-pool", daemon=True)
        self.last_id = "0-0"

    def start(self) -> PoolFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url, password=self.password)
        while not self._stop.is_set():
            try:
                batches: Any = client.xread({STREAM: self.last_id}, count=256, block=500)
            except redis.RedisError as exc:  # Redis restarting: drafts just lack the pool
                log.warning("n-gram pool: %r; retrying", exc)
                self._stop.wait(1.0)
                continue
            for _, entries in batches or ():
                for entry_id, fields in entries:
                    self.pool.learn(decode(fields[b"tokens"]))
                    self.last_id = entry_id.decode()
        client.close()
