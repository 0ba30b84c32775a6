"""Token ids to text, incrementally, with stop strings.

Text is emitted as soon as it is final: never half of a multi-byte character (a byte-level
token can end mid-character, which decodes to U+FFFD until the rest arrives), and never the
first characters of what may turn out to be a stop string (the last `len(longest stop) - 1`
characters are held back until they can no longer begin one). A stop string ends the text
before it, as OpenAI's API does (with vLLM's `include_stop_str_in_output`, after it); with
`min_tokens` (vLLM's), stop strings are looked for once that many tokens are in, in the text
from the held-back characters on.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.model.tokenizer import Tokenizer

# Tokens decoded again with each new one, so context-dependent decoding (leading spaces) is
# right; offsets move forward once text is final.
_CONTEXT_TOKENS = 6


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
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # decoding context starts here
        self._read_offset = 0  # tokens before this are already in self.text
        self.text = ""  # final text so far (complete characters, stop string removed)
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """New final text after these tokens ('' while a character or stop is undecided)."""
        if self.stopped:
            return ""
        self._token_ids.extend(token_ids)
        before = self._decode(self._prefix_offset, self._read_offset)
        after = self._decode(self._prefix_offset, len(self._token_ids))
        if after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its remaining bytes
        self.text += after[len(before) :]
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        if self.stop and len(self._token_ids) >= self.min_tokens and self._find_stop():
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._hold)

    def flush(self) -> str:
        """Whatever was held back, once the sequence is over."""
        return self._emit(len(self.text))

    def _find_stop(self) -> bool:
        window = max(0, self._emitted - self._hold)
        hits = [(i, s) for i, s in ((self.text.find(s, window), s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        start, stop = min(hits, key=lambda hit: hit[0])  # the first to appear
        self.text = self.text[: start + len(stop) if self.include_stop else start]
        self.stopped = True
        return True

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _decode(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        ids = self._token_ids[start:end]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
