"""What router replicas share, kept in Redis (redis-py's asyncio client).

- API keys, stored as SHA-256 digests (a leaked Redis dump gives no usable key), each with its
  own token-bucket rate limit. The bucket lives in Redis and is updated by one Lua script that
  reads Redis's clock, so every replica draws from the same bucket atomically.
- The request registry: request id -> verifier group, replica, state, committed token ids, so
  any replica can report on (or resume from) a request another one is serving.
- The shared n-gram pool: finished sequences appended to a capped stream that engines with an
  `ngram` drafter follow (cluster/ngram_pool.py), so drafting learns across requests.
- Stored responses (the Responses API's `store`): response id -> the response and the input
  items that led to it, for `GET /v1/responses/{id}` and `previous_response_id` on any replica.
- The prefix index: KV block hash -> verifier groups that computed that block recently. Hashes
  are the engine's own chained block hashes, so the router asks "who holds the longest prefix of
  this prompt" without talking to the verifiers. Entries expire: it is a hint, never a promise
  (a verifier may have evicted the block since).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster import ngram_pool
from workers.kv_cache.block_allocator import block_hashes

NAMESPACE = "outrider"
REGISTRY_TTL_S = 3600
RESPONSE_TTL_S = 3600
PREFIX_TTL_S = 600
MAX_INDEXED_BLOCKS = 512  # longest prefix the index tracks, in blocks

# A token bucket per API key: refills at `rate` per second up to `burst`; takes `cost`.
# Returns {allowed (0/1), seconds to wait (string, Lua numbers would truncate)}.
_TOKEN_BUCKET = """
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(held[1]) or burst
local ts = tonumber(held[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, wait = 0, 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(wait)}
"""


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: str
    requests_per_s: float  # 0: unlimited
    burst: int


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float


class SharedState:
    def __init__(self, client: Any, namespace: str = NAMESPACE) -> None:
        self.redis = client
        self.ns = namespace
        self._bucket = client.register_script(_TOKEN_BUCKET)

    def _k(self, *parts: object) -> str:
        return ":".join([self.ns, *map(str, parts)])

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()

    # API keys and rate limits.

    async def add_key(
        self, api_key: str, name: str, requests_per_s: float = 0.0, burst: int = 0
    ) -> ApiKey:
        if not api_key:
            raise ValueError("an API key must not be empty")
        if requests_per_s < 0 or burst < 0:
            raise ValueError("rate limits must be >= 0")
        record = ApiKey(
            name, key_digest(api_key), requests_per_s, burst or max(1, int(requests_per_s))
        )
        value = {"name": name, "requests_per_s": requests_per_s, "burst": record.burst}
        await self.redis.hset(self._k("keys"), record.digest, json.dumps(value))
        return record

    async def remove_key(self, api_key: str) -> bool:
        return bool(await self.redis.hdel(self._k("keys"), key_digest(api_key)))

    async def auth_required(self) -> bool:
        return bool(await self.redis.hlen(self._k("keys")))

    async def lookup_key(self, api_key: str) -> ApiKey | None:
        digest = key_digest(api_key)
        raw = await self.redis.hget(self._k("keys"), digest)
        if raw is None:
            return None
        value = json.loads(raw)
        return ApiKey(value["name"], digest, float(value["requests_per_s"]), int(value["burst"]))

    async def take(self, key: ApiKey, cost: float = 1.0) -> RateDecision:
        """One request's worth from the key's bucket, shared by every replica."""
        if key.requests_per_s <= 0:
            return RateDecision(True, 0.0)
        allowed, wait = await self._bucket(
            keys=[self._k("bucket", key.digest)], args=[key.requests_per_s, key.burst, cost]
        )
        return RateDecision(bool(int(allowed)), float(wait))

    # The request registry.

    async def register(
        self,
        request_id: str,
        group: str,
        replica: str,
        prompt_ids: Sequence[int],
        settings: str,
    ) -> None:
        """A new request: where it runs, and what it takes to resume it (its prompt and its
        settings as JSON) on another replica."""
        key = self._k("request", request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "group": group,
                    "replica": replica,
                    "state": "running",
                    "prompt_tokens": len(prompt_ids),
                    "started": time.time(),
                    "settings": settings,
                },
            )
            prompt_key = self._k("request", request_id, "prompt")
            pipe.set(prompt_key, ngram_pool.encode(prompt_ids))
            for name in (key, prompt_key):
                pipe.expire(name, REGISTRY_TTL_S)
            await pipe.execute()

    async def commit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
    ) -> None:
        """Append committed tokens; with `finish_reason`, mark the request finished."""
        key = self._k("request", request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if token_ids:
                pipe.rpush(self._k("request", request_id, "tokens"), *token_ids)
                pipe.expire(self._k("request", request_id, "tokens"), REGISTRY_TTL_S)
            if finish_reason is not None:
                fields: dict[str, Any] = {"state": "finished", "finish_reason": finish_reason}
                if usage is not None:
                    fields["usage"] = json.dumps(usage)
                pipe.hset(key, mapping=fields)
            await pipe.execute()

    async def move(self, request_id: str, group: str) -> None:
        """The request goes on on `group` (its first one failed under it)."""
        await self.redis.hset(self._k("request", request_id), "group", group)

    async def lookup_request(self, request_id: str) -> dict[str, Any] | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._k("request", request_id))
            pipe.lrange(self._k("request", request_id, "tokens"), 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        record: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
        record["prompt_tokens"] = int(record["prompt_tokens"])
        record["started"] = float(record["started"])
        for name in ("usage", "settings"):
            if name in record:
                record[name] = json.loads(record[name])
        record["token_ids"] = [int(t) for t in tokens]
        return record

    async def lookup_prompt(self, request_id: str) -> list[int] | None:
        raw = await self.redis.get(self._k("request", request_id, "prompt"))
        return None if raw is None else ngram_pool.decode(raw)

    # Stored responses.

    async def save_response(self, response_id: str, record: dict[str, Any]) -> None:
        key = self._k("response", response_id)
        await self.redis.set(key, json.dumps(record), ex=RESPONSE_TTL_S)

    async def load_response(self, response_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._k("response", response_id))
        return None if raw is None else dict(json.loads(raw))

    async def delete_response(self, response_id: str) -> bool:
        return bool(await self.redis.delete(self._k("response", response_id)))

    async def share_sequence(self, token_ids: Sequence[int]) -> None:
        """Offer a finished sequence to every engine's shared n-gram pool."""
        await ngram_pool.publish(self.redis, token_ids)

    # The prefix index.

    async def record_prefix(self, token_ids: Sequence[int], block_size: int, group: str) -> int:
        """Note that `group` now holds the KV blocks of `token_ids`; how many blocks."""
        hashes = block_hashes(token_ids, block_size)[:MAX_INDEXED_BLOCKS]
        if not hashes:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.sadd(self._k("prefix", h), group)
                pipe.expire(self._k("prefix", h), PREFIX_TTL_S)
            await pipe.execute()
        return len(hashes)

    async def cached_blocks(
        self, token_ids: Sequence[int], block_size: int, groups: Sequence[str]
    ) -> dict[str, int]:
        """For each group, how many leading blocks of `token_ids` the index says it holds."""
        hashes = block_hashes(token_ids, block_size)[:MAX_INDEXED_BLOCKS]
        found = dict.fromkeys(groups, 0)
        if not hashes:
            return found
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.smembers(self._k("prefix", h))
            members = await pipe.execute()
        alive = set(groups)
        for depth, holders in enumerate(members):
            alive &= {m.decode() for m in holders}
            if not alive:
                break
            for group in alive:
                found[group] = depth + 1
        return found
