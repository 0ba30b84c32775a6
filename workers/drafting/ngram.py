"""Drafting without a model: continue the text by matching its own recent tokens.

`NgramDrafter` ("prompt lookup", vLLM's `prompt_lookup_min/max`, llama.cpp's
`--spec-ngram-size-n`): find the most recent earlier place where the sequence's last n tokens
(n from max_n down to min_n) occurred, in the prompt or the output so far, and propose the
tokens that followed it there. It shines when the answer quotes or edits its input. Where no
such suffix occurred, the last token alone proposes a short draft (`fallback_tokens`): right
after the answer leaves a quote for a word or two its own last token is new as a pair, but it
often picks the quote up again at once.

`SuffixDrafter` keeps, for every context of min_n..max_n tokens seen in the sequence, how often
each next token followed it (a suffix trie cut at depth max_n + 1), and drafts by repeatedly
taking the most frequent continuation of the longest known context, so a draft can run past
the end of any single earlier match and prefers what repeats most over what came last. It falls
back to one-token contexts as `NgramDrafter` does.

Both are deterministic (q is one-hot) and cost microseconds, so the verifier gets k for free.

`Prediction` drafts from a request's predicted output (OpenAI's Predicted Outputs: the client
sends the text it expects, a file it asks to edit, say). Before the answer has begun it proposes
the prediction's start; then, where the text's last min_n..max_n tokens occur in the prediction,
what follows them there, preferring the first occurrence at or after the place the last draft
came from, so that the drafts walk through the prediction with the answer and pick it up again
after an edit. `NgramDrafter` and the EAGLE drafter try it before anything else.

`SharedNgramPool` lets `NgramDrafter` learn across requests: finished sequences (fed in from
Redis by the runtime, see cluster/ngram_pool.py) are indexed by their n-grams, and when a
sequence's own tokens hold no match the drafter proposes what followed the same n-gram in
another request (two users asking the same question, boilerplate every answer repeats).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workers.drafting.base import Draft, Drafter, DraftRequest, check_view
from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NgramConfig:
    min_n: int = 2  # shortest suffix to match
    max_n: int = 4  # longest suffix to match (tried first)
    # Where no suffix of min_n..max_n tokens occurred before, the last token alone (where it
    # last occurred) proposes at most this many: weaker evidence, a shorter draft (0: none).
    fallback_tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.fallback_tokens < 0:
            raise ValueError(f"fallback_tokens must be >= 0, got {self.fallback_tokens}")


class Prediction:
    """A request's predicted output, and where in it the last draft came from."""

    def __init__(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.tokens = np.asarray(token_ids, dtype=np.int64)
        self.num_prompt_tokens = num_prompt_tokens
        self.cursor = 0  # the prediction continues the answer from about here

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int) -> Prediction | None:
        return cls(params.prediction, num_prompt_tokens) if params.prediction else None

    def draft(self, tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
        """Up to k tokens of the prediction that continue `tokens` (prompt and answer so far,
        with any guessed tokens); [] where the text's end is nowhere in it."""
        if k <= 0:
            return []
        answered = len(tokens) - self.num_prompt_tokens
        if answered <= 0:  # nothing to match yet: the prediction's start
            return self.tokens[:k].tolist()
        # Only the answer's tokens are matched (right after it began, fewer than min_n).
        tail = np.asarray(tokens[-max_n:], dtype=np.int64)
        end = self._match(tail, min(max_n, answered), min(min_n, answered))
        if end is None or end >= len(self.tokens):
            return []
        self.cursor = end
        return self.tokens[end : end + k].tolist()

    def _match(self, tail: np.ndarray, max_n: int, min_n: int) -> int | None:
        """Where the longest of the text's last max_n..min_n tokens ends in the prediction."""
        for n in range(min(max_n, len(self.tokens)), min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(self.tokens, n)
            hits = np.flatnonzero((windows == tail[-n:]).all(axis=1)) + n
            if len(hits):
                ahead = hits[hits >= self.cursor]
                return int(ahead[0] if len(ahead) else hits[-1])
        return None


class _TokenDrafter(Drafter):
    """Keeps each sequence's committed tokens (and predicted output); subclasses draft from
    them."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._tokens: dict[str, list[int]] = {}
        self._predictions: dict[str, Prediction] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokens[request_id] = []
        if prediction := Prediction.of(params, len(prompt_token_ids)):
            self._predictions[request_id] = prediction
        self.commit(request_id, prompt_token_ids)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._tokens[request_id].extend(token_ids)

    def remove(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._predictions.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for req in requests:
            tokens = self._tokens[req.request_id]
            check_view(req, len(tokens))
            prediction = self._predictions.get(req.request_id)
            found = (
                []
                if prediction is None
                else prediction.draft(tokens, req.k, self.config.min_n, self.config.max_n)
            )
            drafts[req.request_id] = Draft(found or self._draft(req.request_id, tokens, req.k))
        return drafts

    def _draft(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError


class SharedNgramPool:
    """n-grams of other requests' sequences -> the tokens that followed them (most recent wins),
    bounded (least recently written n-grams go first). Thread-safe: a follower thread learns while
    the engine thread drafts."""

    def __init__(
        self,
        min_n: int = 3,
        max_n: int = 4,
        continuation: int = 16,
        capacity: int = 200_000,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.continuation, self.capacity = (
            min_n,
            max_n,
            continuation,
            capacity,
        )
        self._table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.sequences = 0  # learned so far

    def __len__(self) -> int:
        return len(self._table)

    def learn(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        with self._lock:
            for end in range(self.min_n, len(tokens)):
                follow = tuple(tokens[end : end + self.continuation])
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    key = tuple(tokens[end - n : end])
                    self._table[key] = follow
                    self._table.move_to_end(key)
            while len(self._table) > self.capacity:
                self._table.popitem(last=False)
            self.sequences += 1

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest known suffix of `tokens`."""
        if k <= 0:
            return []
        with self._lock:
            for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
                follow = self._table.get(tuple(tokens[-n:]))
                if follow:
                    return list(follow[:k])
        return []


class NgramDrafter(_TokenDrafter):
    method = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        super().__init__(config)
        self.pool: SharedNgramPool | None = None  # set by the runtime when Redis shares one
        self._indexes: dict[str, LookupIndex] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._indexes.pop(request_id, None)  # a text that starts over
        super().add(request_id, prompt_token_ids, params)

    def remove(self, request_id: str) -> None:
        super().remove(request_id)
        self._indexes.pop(request_id, None)

    def _draft(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        config = self.config
        index = self._indexes.get(request_id)
        if index is None:  # the fallback's one-token n-grams too
            low = 1 if config.fallback_tokens else config.min_n
            index = self._indexes[request_id] = LookupIndex(low, config.max_n)
        draft = index.find(tokens, k, config.min_n, config.max_n)
        if not draft and self.pool is not None:  # another request's n-gram: stronger evidence
            draft = self.pool.lookup(tokens, k)
        if not draft and config.min_n > 1 and config.fallback_tokens:
            draft = index.find(tokens, min(k, config.fallback_tokens), 1, 1)
        return draft


def prompt_lookup(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching
    suffix (max_n down to min_n tokens); [] when nothing matches."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(arr) - 1), min_n - 1, -1):
        suffix = arr[-n:]
        # Windows that start before the suffix itself: positions 0 .. len - n - 1.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


# An n-gram's key in `LookupIndex`: its tokens packed above a leading 1 (so lengths differ),
# each in this many bits (token ids below 2**21, past any vocabulary served).
_KEY_BITS = 21


class LookupIndex:
    """`prompt_lookup` over a text that only grows, without a scan: where each n-gram of
    `min_n..max_n` tokens last occurred with a token after it, indexed up to the text's end
    when asked (so a sequence that never drafts costs nothing). A lookup is a few dict reads."""

    __slots__ = ("_last", "_seen", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[int, int] = {}  # n-gram key -> its latest start followed by a token
        self._seen = 0  # tokens of the text indexed so far

    def find(self, tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
        """`prompt_lookup(tokens, k, min_n, max_n)` (within the index's n), for `tokens` the
        text given before, grown."""
        if not self.min_n <= min_n <= max_n <= self.max_n:
            raise ValueError(f"n-grams of {min_n}..{max_n} are not all indexed")
        if k <= 0 or len(tokens) <= min_n:
            return []
        self._index(tokens)
        last = self._last
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            start = last.get(_key(tokens, len(tokens) - n, n))
            if start is not None:
                return list(tokens[start + n : start + n + k])
        return []

    def _index(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that a token after them closed since the last call."""
        last, lo, hi = self._last, self.min_n, self.max_n
        for end in range(max(self._seen, 1), len(tokens)):  # tokens[end] follows the n-grams
            for n in range(lo, min(hi, end) + 1):
                last[_key(tokens, end - n, n)] = end - n
        self._seen = max(self._seen, len(tokens))


def _key(tokens: Sequence[int], start: int, n: int) -> int:
    key = 1
    for token in tokens[start : start + n]:
        key = (key << _KEY_BITS) | token
    return key


class SuffixDrafter(_TokenDrafter):
    method = "suffix"

    def __init__(self, config: NgramConfig | None = None) -> None:
        super().__init__(config)
        # request -> context (tuple of n tokens) -> next token -> (count, last position)
        self._tables: dict[str, defaultdict[tuple[int, ...], Counter[int]]] = {}
        self._last_seen: dict[str, dict[tuple[tuple[int, ...], int], int]] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tables[request_id] = defaultdict(Counter)
        self._last_seen[request_id] = {}
        super().add(request_id, prompt_token_ids, params)

    @property
    def _shortest(self) -> int:
        """The shortest context indexed: min_n, or 1 for the fallback."""
        return 1 if self.config.fallback_tokens else self.config.min_n

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        tokens = self._tokens[request_id]
        table, last_seen = self._tables[request_id], self._last_seen[request_id]
        for token in token_ids:
            position = len(tokens)
            for n in range(self._shortest, min(self.config.max_n, position) + 1):
                context = tuple(tokens[position - n :])
                table[context][token] += 1
                last_seen[(context, token)] = position
            tokens.append(token)

    def remove(self, request_id: str) -> None:
        super().remove(request_id)
        self._tables.pop(request_id, None)
        self._last_seen.pop(request_id, None)

    def _draft(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        table, last_seen = self._tables[request_id], self._last_seen[request_id]
        context = list(tokens[-self.config.max_n :])
        draft: list[int] = []
        while len(draft) < k:
            found = self._continuation(context, table, last_seen)
            if found is None:
                break
            token, n = found
            if n < self.config.min_n:  # a one-token context: a short draft
                k = min(k, max(self.config.fallback_tokens, len(draft) + 1))
            draft.append(token)
            context = (
                [*context[1:], token] if len(context) == self.config.max_n else [*context, token]
            )
        return draft

    def _continuation(
        self,
        context: list[int],
        table: defaultdict[tuple[int, ...], Counter[int]],
        last_seen: dict[tuple[tuple[int, ...], int], int],
    ) -> tuple[int, int] | None:
        """The next token after `context` and the length of the context that chose it."""
        for n in range(min(self.config.max_n, len(context)), self._shortest - 1, -1):
            key = tuple(context[-n:])
            followers = table.get(key)
            if followers:
                # Most frequent next token; ties go to the one seen most recently.
                token = max(followers, key=lambda t: (followers[t], last_seen[(key, t)]))
                return token, n
        return None
