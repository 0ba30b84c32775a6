"""Counter-based uniform random numbers: a hash of (key, counter, lane), as tensor code.

The device sampler draws from here instead of a `torch.Generator` per request. One launch
serves the whole batch, and a request's numbers depend only on its key (its seed), the position
it samples at (`counter`) and which draw of that position it is (`lane`), never on its batch or
device. A sequence never samples at the same position twice with the same lanes (each step
starts past the last committed token), so no number is reused.

The hash is Wellons' "lowbias32" (two multiply-xorshift rounds, full avalanche on 32 bits), in
int64 arithmetic that never overflows: products are taken 16 bits at a time.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Lanes at and above this draw the final token's exponential race, one per vocabulary entry;
# lanes below it are the acceptance tests of draft positions 0, 1, ...
VOCAB_LANE_BASE = 1 << 20


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for x in [0, 2^32) (int64), with every product below 2^49."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * m + (((hi * m) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:  # int64 in [0, 2^32) -> same
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """`hash32` of one Python int (on the host, for keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def key_of_seed(seed: int) -> int:
    """A request's 32-bit key from its seed (any Python int, negative ones too)."""
    seed &= (1 << 64) - 1
    return hash32_int((seed & MASK32) ^ hash32_int((seed >> 32) ^ 0x9E3779B9))


MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """A 64-bit seed for a host `torch.Generator` from a request's seed and a position
    (splitmix64 of the pair). The host sampler seeds a seeded request's generator this way at
    each step, from the position it samples at, so its draws depend on where it samples and
    never on what it drew before: a request continued on another engine with its output draws
    on as it would have (the device sampler's numbers are keyed the same way)."""
    x = ((seed & MASK64) * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(
    keys: torch.Tensor,  # [num_rows] int64 in [0, 2^32)
    counters: torch.Tensor,  # [num_rows] int64 >= 0
    lanes: torch.Tensor,  # [num_lanes] int64 >= 0
) -> torch.Tensor:  # [num_rows, num_lanes] fp32 in (0, 1)
    """Row r's numbers at `lanes` for (keys[r], counters[r]): 24 random bits each, centred in
    their interval so that neither 0 nor 1 occurs (a log of either is safe)."""
    row = hash32(keys ^ hash32((counters & MASK32) ^ 0x85EBCA6B))  # [num_rows]
    h = hash32(row.unsqueeze(1) ^ hash32(lanes & MASK32).unsqueeze(0))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
