"""What router replicas share, kept in Redis (redis-py's asyncio client).

- A mirror of the API keys (SHA-256 digests, a leaked Redis dump gives no usable key), which
  each replica rewrites from its own configuration (router/keys.py): Redis never decides who
  gets in. Each key's token buckets (requests, and prompt plus completion tokens) live in Redis
  and are updated by one Lua script that reads Redis's clock, so every replica draws from the
  same buckets atomically.
- The request registry: request id -> owner (its key's digest), verifier group, replica, state,
  committed token ids, and what resuming it takes (prompt and settings, once a prompt, up to
  `MAX_RESUME_BYTES`), so any replica can report on (or resume from) a request another one is
  serving, for the key that made it.
- The shared n-gram pool: finished sequences appended to a capped stream that engines with an
  `ngram` drafter follow (cluster/ngram_pool.py), so drafting learns across requests.
- Stored responses (the Responses API's `store`): response id -> its owner, the response and
  the input items that led to it, for `GET /v1/responses/{id}` and `previous_response_id` on
  any replica.
- Concurrency leases: each API key's unfinished requests over all replicas, one lease each
  in a sorted set scored by its expiry (Redis's clock), taken by one Lua script that drops the
  expired ones and counts the rest, renewed by the replica holding it; a replica that dies
  stops renewing, and its leases lapse within `LEASE_S`.
- The prefix index: KV block hash -> verifier groups that computed that block recently. Hashes
  are the engine's own chained block hashes, so the router asks "who holds the longest prefix of
  this prompt" without talking to the verifiers. Entries expire: it is a hint, never a promise
  (a verifier may have evicted the block since).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster import ngram_pool
from router.keys import ApiKey
from workers.kv_cache.block_allocator import block_hashes

NAMESPACE = "outrider"
REGISTRY_TTL_S = 3600
RESPONSE_TTL_S = 3600
PREFIX_TTL_S = 600
KEYS_TTL_S = 600  # the key mirror's; each replica rewrites it more often (router/server.py)
LEASE_S = 15.0  # a concurrency lease lapses this long after its replica last renewed it
MAX_INDEXED_BLOCKS = 512  # longest prefix the index tracks, in blocks
# A request's prompt and settings are kept for resuming up to this size (its stop strings,
# grammar, logit bias and prompt); a larger one is served, but cannot be resumed.
MAX_RESUME_BYTES = 1 << 20
# The ids clients may name (ours are `cmpl-<hex>`, `resp_<hex>`, `grpc-<hex>`, and `-<k>` for
# a choice); anything else is not an id, and never reaches a Redis key.
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


# A registered request's later writes, applied only while its entry exists: a write that comes
# after the entry was deleted (its response deleted, `store: false`) or expired never brings a
# partial entry back. KEYS: the entry, its token list. ARGV: TTL, finish reason ('' none),
# usage JSON ('' none), group moved to ('' none), then the committed token ids.
_UPDATE_REQUEST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 4 then
  for i = 5, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
  redis.call('EXPIRE', KEYS[2], ARGV[1])
end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'state', 'finished', 'finish_reason', ARGV[2])
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'usage', ARGV[3]) end
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'group', ARGV[4]) end
return 1
"""


def valid_id(object_id: str) -> bool:
    return _ID.fullmatch(object_id) is not None


# A token bucket per API key: refills at `rate` per second up to `burst`; takes `cost` (a
# negative cost gives back what a request took and did not use). Returns {allowed (0/1),
# seconds to wait (string, Lua numbers would truncate)}.
_TOKEN_BUCKET = """
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(held[1]) or burst
local ts = tonumber(held[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, wait = 0, 0
if cost <= 0 then
  tokens = math.min(burst, tokens - cost)
  allowed = 1
elseif tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(wait)}
"""


# Take a lease on one of a key's `limit` places: expired leases dropped, then one more if fewer
# than `limit` are held. KEYS: the key's lease set. ARGV: limit, lease id, lease seconds.
_TAKE_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 1000) + 1000)
return 1
"""
# Renew leases still held. KEYS: lease sets; ARGV: lease seconds, then the lease ids (one a key).
_RENEW_LEASES = """
local t = redis.call('TIME')
local until = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  if redis.call('ZADD', key, 'XX', 'CH', until, ARGV[i + 1]) >= 0 then
    redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[1]) * 1000) + 1000)
  end
end
return #KEYS
"""


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float


class SharedState:
    def __init__(self, client: Any, namespace: str = NAMESPACE) -> None:
        self.redis = client
        self.ns = namespace
        self._bucket = client.register_script(_TOKEN_BUCKET)
        self._take_lease = client.register_script(_TAKE_LEASE)
        self._renew_leases = client.register_script(_RENEW_LEASES)
        self._update = client.register_script(_UPDATE_REQUEST)

    def _k(self, *parts: object) -> str:
        return ":".join([self.ns, *map(str, parts)])

    def _request_names(self, request_id: str) -> tuple[str, str, str]:
        """A request's registry keys: its entry (a hash), its committed tokens, its prompt."""
        entry = self._k("request", request_id)
        return entry, f"{entry}:tokens", f"{entry}:prompt"

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()

    # API keys and rate limits.

    async def sync_keys(self, keys: Sequence[ApiKey]) -> None:
        """Make the key mirror exactly `keys` (digest -> name and limits): keys taken out of a
        replica's configuration leave it, and a mirror Redis lost comes back."""
        name = self._k("keys")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(name)
            if keys:
                pipe.hset(name, mapping={k.digest: _key_record(k) for k in keys})
                pipe.expire(name, KEYS_TTL_S)
            await pipe.execute()

    async def mirrored_keys(self) -> dict[str, dict[str, Any]]:
        """The key mirror: digest -> name and limits."""
        raw = await self.redis.hgetall(self._k("keys"))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def take(self, key: ApiKey, cost: float = 1.0) -> RateDecision:
        """One request's worth from the key's request bucket, shared by every replica."""
        if key.requests_per_s <= 0:
            return RateDecision(True, 0.0)
        return await self._draw("bucket", key, key.requests_per_s, key.burst, cost)

    async def take_tokens(self, key: ApiKey, tokens: int) -> RateDecision:
        """`tokens` from the key's token bucket (negative: give back what went unused)."""
        limits = key.limits
        if limits.tokens_per_s <= 0 or tokens == 0:
            return RateDecision(True, 0.0)
        return await self._draw("tokens", key, limits.tokens_per_s, limits.tokens_burst, tokens)

    async def _draw(
        self, bucket: str, key: ApiKey, rate: float, burst: int, cost: float
    ) -> RateDecision:
        allowed, wait = await self._bucket(
            keys=[self._k(bucket, key.digest)], args=[rate, burst, cost]
        )
        return RateDecision(bool(int(allowed)), float(wait))

    # The request registry.

    async def take_lease(self, key: ApiKey, lease_id: str, lease_s: float = LEASE_S) -> bool:
        """One of the key's `concurrency` places over all replicas, or False."""
        limit = key.limits.max_concurrent
        taken = await self._take_lease(
            keys=[self._k("leases", key.digest)], args=[limit, lease_id, lease_s]
        )
        return bool(taken)

    async def renew_leases(
        self, leases: Sequence[tuple[str, str]], lease_s: float = LEASE_S
    ) -> None:
        """Keep these (key digest, lease id) alive another `lease_s` seconds."""
        if leases:
            names = [self._k("leases", digest) for digest, _ in leases]
            await self._renew_leases(keys=names, args=[lease_s, *(lid for _, lid in leases)])

    async def release_lease(self, digest: str, lease_id: str) -> None:
        await self.redis.zrem(self._k("leases", digest), lease_id)

    async def leases_held(self, key: ApiKey) -> int:
        """The key's live leases (for tests and operators)."""
        name = self._k("leases", key.digest)
        return int(await self.redis.zcount(name, time.time(), "+inf"))

    async def register(self, request_id: str, entry: Registration) -> None:
        """A new request: where it runs, whose it is, and what it takes to resume it (its
        prompt and its settings as JSON) on another replica, unless it shares them."""
        key, _, prompt_key = self._request_names(request_id)
        fields: dict[str, Any] = {
            "owner": entry.owner,
            "group": entry.group,
            "replica": entry.replica,
            "state": "running",
            "prompt_tokens": len(entry.prompt_ids),
            "started": time.time(),
        }
        prompt = None
        if entry.resume_from is not None:
            fields["resume_from"], fields["choice"] = entry.resume_from, entry.choice
        else:
            prompt = ngram_pool.encode(entry.prompt_ids, last=None)
            if len(prompt) + len(entry.settings) <= MAX_RESUME_BYTES:
                fields["settings"] = entry.settings
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, REGISTRY_TTL_S)
            if "settings" in fields:
                pipe.set(prompt_key, prompt, ex=REGISTRY_TTL_S)
            await pipe.execute()

    async def commit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        forget: bool = False,
    ) -> None:
        """Append committed tokens; with `finish_reason`, mark the request finished, or with
        `forget` too (`store: false`) delete all the registry holds of it."""
        names = self._request_names(request_id)
        if finish_reason is not None and forget:
            await self.redis.delete(*names)
            return
        finish = "" if finish_reason is None else finish_reason
        used = "" if usage is None else json.dumps(usage)
        await self._update(keys=names[:2], args=[REGISTRY_TTL_S, finish, used, "", *token_ids])

    async def move(self, request_id: str, group: str) -> None:
        """The request goes on on `group` (its first one failed under it)."""
        names = self._request_names(request_id)
        await self._update(keys=names[:2], args=[REGISTRY_TTL_S, "", "", group])

    async def lookup_request(self, request_id: str) -> dict[str, Any] | None:
        if not valid_id(request_id):
            return None
        entry, tokens_key, _ = self._request_names(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(entry)
            pipe.lrange(tokens_key, 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        record: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
        record["prompt_tokens"] = int(record["prompt_tokens"])
        record["started"] = float(record["started"])
        for name in ("usage", "settings"):
            if name in record:
                record[name] = json.loads(record[name])
        if "choice" in record:
            record["choice"] = int(record["choice"])
        record["token_ids"] = [int(t) for t in tokens]
        return record

    async def lookup_resume(
        self, request_id: str, record: dict[str, Any]
    ) -> tuple[list[int], dict[str, Any]] | None:
        """What resuming request `request_id` (its registry `record`) takes: its prompt and
        settings, from the choice it shares them with where it does; None when not kept."""
        source = record.get("resume_from")
        if source is not None:
            shared = await self.lookup_request(source)
            if shared is None or shared.get("owner") != record.get("owner"):
                return None
            request_id, record = source, shared
        if "settings" not in record:
            return None
        raw = await self.redis.get(self._request_names(request_id)[2])
        return None if raw is None else (ngram_pool.decode(raw), record["settings"])

    # Stored responses.

    async def save_response(self, response_id: str, record: dict[str, Any]) -> None:
        key = self._k("response", response_id)
        await self.redis.set(key, json.dumps(record), ex=RESPONSE_TTL_S)

    async def load_response(self, response_id: str) -> dict[str, Any] | None:
        if not valid_id(response_id):
            return None
        raw = await self.redis.get(self._k("response", response_id))
        return None if raw is None else dict(json.loads(raw))

    async def delete_response(self, response_id: str) -> bool:
        """The stored response and the registry's entry of the request that made it."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("response", response_id))
            pipe.delete(*self._request_names(response_id))
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def share_sequence(self, token_ids: Sequence[int]) -> None:
        """Offer a finished sequence to every engine's shared n-gram pool."""
        await ngram_pool.publish(self.redis, token_ids)

    # The prefix index.

    async def record_prefix(
        self, token_ids: Sequence[int], block_size: int, group: str, salt: int = 0
    ) -> int:
        """Note that `group` now holds the KV blocks of `token_ids` (under cache salt `salt`);
        how many blocks."""
        hashes = block_hashes(token_ids, block_size, salt)[:MAX_INDEXED_BLOCKS]
        if not hashes:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.sadd(self._k("prefix", h), group)
                pipe.expire(self._k("prefix", h), PREFIX_TTL_S)
            await pipe.execute()
        return len(hashes)

    async def cached_blocks(
        self, token_ids: Sequence[int], block_size: int, groups: Sequence[str], salt: int = 0
    ) -> dict[str, int]:
        """For each group, how many leading blocks of `token_ids` (under cache salt `salt`)
        the index says it holds."""
        hashes = block_hashes(token_ids, block_size, salt)[:MAX_INDEXED_BLOCKS]
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


@dataclass(frozen=True, slots=True)
class Registration:
    """What the registry keeps of a new request (router/service.py writes it)."""

    group: str
    replica: str
    owner: str  # the digest of the API key that made it; "" where keys are not configured
    prompt_ids: list[int]
    settings: str  # what a replica needs besides the prompt to resume it, as JSON
    # Choice `choice` of a request whose other choices share prompt and settings: they are
    # kept once, with the choice named here.
    resume_from: str | None = None
    choice: int = 0


def _key_record(key: ApiKey) -> str:
    limits = key.limits
    return json.dumps(
        {
            "name": key.name,
            "requests_per_s": limits.requests_per_s,
            "burst": key.burst,
            "max_concurrent": limits.max_concurrent,
            "tokens_per_s": limits.tokens_per_s,
            "token_burst": limits.tokens_burst if limits.tokens_per_s else 0,
            "isolate_cache": limits.isolate_cache,
        }
    )
