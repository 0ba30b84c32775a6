"""What the EAGLE drafter (workers/drafting/eagle.py) holds for one sequence, and how its head
cache follows the verifier.

The head's one-layer paged KV cache holds, in row r, the head's input for position base + r
(the target feature there plus the token after it). Rows made from target features come first
(`rows` of them); a proposal's draft rows follow and are rolled back by the next proposal. Target
features that arrived since the last proposal wait in `pending` until a proposal feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.drafting.ahead import AheadState
from workers.drafting.base import DraftRandom
from workers.drafting.ngram import LookupIndex, Prediction
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import GrammarState
from workers.kv_cache import BlockTable


@dataclass(slots=True)
class EagleSeq:
    params: SamplingParams
    table: BlockTable
    random: DraftRandom | None  # a seeded request's numbers
    tokens: list[int]  # committed
    base: int | None = None  # position of cache row 0
    features_end: int = 0  # features received for positions < features_end
    pending: list[torch.Tensor] = field(default_factory=list)  # features not yet in the cache
    rows: int = 0  # cache rows made from target features (the rest are draft rows)
    cached: int = 0  # cache rows written, feature rows then the last proposal's draft rows
    last_feature: torch.Tensor | None = None  # the last feature row in the cache, to redo it
    ahead: AheadState = field(default_factory=AheadState)
    prediction: Prediction | None = None  # the request's predicted output, drafted from first
    grammar: GrammarState | None = None  # the request's, at its committed tokens
    # (committed tokens, what prompt lookup found after them): a lookup made to price the next
    # draft, reused by it
    looked_up: tuple[int, list[int]] | None = None
    index: LookupIndex | None = None  # prompt lookup's over the committed tokens

    @property
    def can_draft(self) -> bool:
        """Drafting needs the feature of every position before the last committed token."""
        return self.base is not None and self.features_end == len(self.tokens) - 1

    @property
    def num_pending(self) -> int:
        return sum(p.shape[0] for p in self.pending)

    def new_rows(self) -> torch.Tensor | None:
        """Roll the head cache back to the feature rows and return the features to feed next:
        those received since the last proposal, or (none received) the last feature row again;
        None when there are neither."""
        assert self.base is not None
        self.truncate(self.rows)  # drop the last proposal's draft rows
        if self.pending:
            return self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        if self.last_feature is None:
            return None
        self.rows -= 1
        self.truncate(self.rows)
        return self.last_feature

    def next_ids(self, count: int) -> list[int]:
        """The token after each of the next `count` feature rows."""
        assert self.base is not None
        first = self.base + self.rows
        return self.tokens[first + 1 : first + 1 + count]

    def fed(self, features: torch.Tensor) -> None:
        """The cache now holds rows made from `features` after the feature rows."""
        self.rows += features.shape[0]
        self.pending, self.last_feature = [], features[-1:]

    def truncate(self, rows: int) -> None:
        self.table.truncate(rows)
        self.cached = rows

    def reset(self) -> None:
        """Forget the head cache and the features; the next features start it anew."""
        self.truncate(0)
        self.base, self.features_end, self.pending, self.rows, self.last_feature = (
            None,
            0,
            [],
            0,
            None,
        )
