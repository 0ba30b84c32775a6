"""API keys: which ones a router replica accepts, and the limits each one runs under.

A replica's keys are its own configuration (a keys file, from a Kubernetes Secret in the
chart, or a list given in code), never what Redis holds: a Redis that lost its data, was
failed over or was written to by anyone holding its password can neither open the API nor add
a key. A replica given a keys file requires a key even when the file becomes empty (then none
is valid). The file is read again when it changes (a Secret's update reaches the pod as a new
file), so a key removed from it is revoked on every replica that mounts it within
`RELOAD_EVERY_S` of the change; a file that cannot be read or parsed keeps the keys it had.

Keys are held as SHA-256 digests only. Redis keeps a mirror of them (digest -> name and limits,
router/state.py `sync_keys`) that each replica rewrites from its configuration, so a key taken
out of the configuration leaves Redis too and a mirror that was lost comes back.

The keys file has one key a line: `<key> [name] [requests/s] [burst] [option=value ...]`
with `#` comments. Options: `concurrency` (unfinished requests at once over all replicas,
leases in Redis: router/state.py),
`tokens_per_s` and `token_burst` (prompt plus completion tokens, shared by the replicas through
Redis), `isolate_cache` (true: the key's requests share no cache with other keys'), `weight`
(the key's share of the engine against other keys': workers/engine/fair_share.py), `priority`
(its requests' priority when they name none; lower runs first) and `best_priority` (the most
urgent priority its requests may ask for). What a line leaves out comes from the router's
defaults (`KeyLimits`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.engine.fair_share import Share

log = logging.getLogger(__name__)

RELOAD_EVERY_S = 5.0  # how often a replica looks at its keys file for a change


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What one key may use; 0 means no limit."""

    requests_per_s: float = 0.0
    burst: int = 0  # requests the bucket holds; 0: requests_per_s rounded up, at least 1
    max_concurrent: int = 0  # unfinished requests of the key on one replica
    tokens_per_s: float = 0.0  # prompt + max_tokens of each choice, refunded what went unused
    token_burst: int = 0  # tokens the bucket holds; 0: a minute's worth
    isolate_cache: bool = False  # no shared prefix cache, prefix index or n-gram pool
    weight: float = 1.0  # the key's share of the engine against other keys'
    priority: int = 0  # its requests' priority where they name none (lower runs first)
    best_priority: int = 0  # the most urgent (lowest) priority its requests may ask for

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "burst", "max_concurrent", "tokens_per_s", "token_burst"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        Share(weight=self.weight, priority=self.priority)  # in range, or ValueError naming it
        Share(priority=self.best_priority)
        if self.priority < self.best_priority:
            raise ValueError(
                f"priority {self.priority} is more urgent than best_priority {self.best_priority}"
            )

    @property
    def request_burst(self) -> int:
        return self.burst or max(1, int(self.requests_per_s + 0.999))

    @property
    def tokens_burst(self) -> int:
        return self.token_burst or max(1, int(self.tokens_per_s * 60))


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    digest: str
    limits: KeyLimits = KeyLimits()

    @property
    def requests_per_s(self) -> float:
        return self.limits.requests_per_s

    @property
    def burst(self) -> int:
        return self.limits.request_burst


@dataclass(frozen=True, slots=True)
class KeyLine:
    """One configured key; None fields take the router's defaults."""

    key: str
    name: str
    requests_per_s: float | None = None
    burst: int | None = None
    options: tuple[tuple[str, str], ...] = ()

    def api_key(self, defaults: KeyLimits) -> ApiKey:
        limits = defaults
        if self.requests_per_s is not None:
            limits = replace(limits, requests_per_s=self.requests_per_s)
        if self.burst is not None:
            limits = replace(limits, burst=self.burst)
        changes: dict[str, Any] = {o: _option_value(o, v) for o, v in self.options}
        limits = replace(limits, **changes)
        return ApiKey(self.name, key_digest(self.key), limits)


_OPTIONS = {"concurrency": "max_concurrent", "tokens_per_s": "tokens_per_s"}
_OPTIONS |= {"token_burst": "token_burst", "isolate_cache": "isolate_cache"}
_OPTIONS |= {"weight": "weight", "priority": "priority", "best_priority": "best_priority"}


def _option_value(option: str, value: str) -> float | int | bool:
    if option == "isolate_cache":
        if value.lower() not in ("true", "false"):
            raise ValueError(f"isolate_cache must be true or false, not {value!r}")
        return value.lower() == "true"
    return float(value) if option in ("tokens_per_s", "weight") else int(value)


def read_keys_file(path: str | Path) -> list[KeyLine]:
    """Parse an API keys file; raises ValueError naming the bad line."""
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        positional = [f for f in fields if "=" not in f]
        named = [f.partition("=")[::2] for f in fields if "=" in f]
        if len(positional) > 4 or fields[: len(positional)] != positional:
            raise ValueError(
                f"{path}:{number}: expected '<key> [name] [requests/s] [burst] [option=value ...]'"
            )
        try:
            rate = float(positional[2]) if len(positional) > 2 else None
            burst = int(positional[3]) if len(positional) > 3 else None
        except ValueError:
            raise ValueError(f"{path}:{number}: requests/s and burst must be numbers") from None
        name = positional[1] if len(positional) > 1 else f"key-{number}"
        try:
            options = tuple((_OPTIONS[option], value) for option, value in named)
            parsed = KeyLine(fields[0], name, rate, burst, options)
            parsed.api_key(KeyLimits())  # its values checked here, where the line is known
        except KeyError as exc:
            raise ValueError(
                f"{path}:{number}: unknown option {exc.args[0]!r} (known: {', '.join(_OPTIONS)})"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        keys.append(parsed)
    return keys


class KeyRing:
    """The keys one replica accepts: the lines it was given, then its keys file's, as the file
    is now. `configured`: whether requests need a key at all."""

    def __init__(
        self,
        lines: list[KeyLine] | None = None,
        path: str | Path | None = None,
        defaults: KeyLimits | None = None,
    ) -> None:
        self.defaults = defaults or KeyLimits()
        self.path = None if path is None else Path(path)
        self._given = list(lines or [])
        # Taken before the file is read: a change while it is read is read again.
        self._stamp = None if self.path is None else _stamp(self.path)
        self._keys: dict[str, ApiKey] = {}
        self._build(read_keys_file(self.path) if self.path is not None else [])

    @property
    def configured(self) -> bool:
        return self.path is not None or bool(self._given)

    @property
    def keys(self) -> list[ApiKey]:
        return list(self._keys.values())

    def lookup(self, api_key: str) -> ApiKey | None:
        return self._keys.get(key_digest(api_key))

    def reload_if_changed(self) -> bool:
        """Read the keys file again if it changed since it was read; whether the keys did.
        A file that cannot be read or parsed keeps the keys already held (and is logged)."""
        if self.path is None:
            return False
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return False
            lines = read_keys_file(self.path)
        except (OSError, ValueError) as exc:
            log.warning("API keys file %s unreadable, keeping its last keys: %s", self.path, exc)
            return False
        self._stamp = stamp
        before = dict(self._keys)
        self._build(lines)
        if before == self._keys:
            return False
        gone, added = set(before) - set(self._keys), set(self._keys) - set(before)
        log.warning("API keys reloaded: %d added, %d revoked", len(added), len(gone))
        return True

    def _build(self, from_file: list[KeyLine]) -> None:
        keys: dict[str, ApiKey] = {}
        for line in [*self._given, *from_file]:
            if not line.key:
                raise ValueError("an API key must not be empty")
            key = line.api_key(self.defaults)
            keys[key.digest] = key
        self._keys = keys


def _stamp(path: Path) -> tuple[int, int, int]:
    """What changes when a file (or the file a Secret's symlink names) is replaced."""
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size
