"""Token ids to text, incrementally, with stop strings.

Text is emitted as soon as it is final: never half of a multi-byte character (a byte-level
token can end mid-character; `tokenizers`' `DecodeStream` holds such tokens back until the rest
arrives, decoding each new token against the few before it, in Rust, once), and never the
first characters of what may turn out to be a stop string (the last `len(longest stop) - 1`
characters are held back until they can no longer begin one). A stop string ends the text
before it, as OpenAI's API does (with vLLM's `include_stop_str_in_output`, after it); with
`min_tokens` (vLLM's), stop strings are looked for once that many tokens are in, in the text
from the held-back characters on.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from workers.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._num_tokens = 0
        # The end of the final text (complete characters, stop string removed) from `_hold`
        # characters before what was emitted: where a stop string may still be found. Without
        # stop strings nothing is held or searched, and every piece goes out as it comes.
        self._tail = ""
        self._emitted = 0  # characters of `_tail` already emitted
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """New final text after these tokens ('' while a character or stop is undecided)."""
        if self.stopped:
            return ""
        step, backend = self._stream.step, self.tokenizer.backend
        # A piece is None while a character is still incomplete.
        if len(token_ids) == 1:  # a decode step's one token
            new = step(backend, token_ids[0]) or ""
        else:
            new = "".join(piece for piece in (step(backend, t) for t in token_ids) if piece)
        self._num_tokens += len(token_ids)
        if not self.stop:
            return new
        self._tail += new
        if self._num_tokens >= self.min_tokens and self._find_stop():
            return self._emit(len(self._tail))
        return self._emit(len(self._tail) - self._hold)

    def flush(self) -> str:
        """Whatever was held back, once the sequence is over."""
        return self._emit(len(self._tail))

    def _find_stop(self) -> bool:
        found = ((self._tail.find(s), s) for s in self.stop)
        hits = [(i, s) for i, s in found if i >= 0]
        if not hits:
            return False
        start, stop = min(hits, key=lambda hit: hit[0])  # the first to appear
        self._tail = self._tail[: start + len(stop) if self.include_stop else start]
        self.stopped = True
        return True

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._tail[self._emitted : end]
        cut = max(0, end - self._hold)  # keep the last `_hold` emitted characters
        self._tail, self._emitted = self._tail[cut:], end - cut
        return delta
