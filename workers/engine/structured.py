"""Structured output: an answer held to a grammar (a JSON schema, a regular expression, a choice
of strings or a Lark grammar).

llguidance (the Rust library vLLM and SGLang also use) turns each kind into one grammar and
follows a sequence through it: at every position it gives the set of tokens that keep the text
inside the grammar, and the engine masks the rest of that position's logits to -inf before
sampling. Verification masks each row of a draft the same way, with the grammar advanced over
the drafts before that row and then rolled back, so speculation stays exact: a draft the grammar
forbids has probability 0 under the masked target and is always rejected. The EAGLE drafter
follows the grammar too (its own copy, masking the head's draft distribution), so that its
drafts are ones the target can accept; that changes what is drafted, never what is committed.

A sequence finishes as soon as its grammar can take nothing more (a closed JSON value, the end
of a choice): the EOS token, the only one left, is not generated.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import torch

from workers.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # a TypedDict of llguidance's type stubs only
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json", "regex", "choice", "grammar")

# JSON's whitespace between tokens: a few spaces, or a line break and its indentation. Any amount
# is valid JSON, but a small model held to JSON can fall into a loop of blank lines that only
# max_tokens ends. A schema's own "x-guidance" options (llguidance's) override this.
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_pattern": r"[\x20\x09]{0,4}(\x0D?\x0A[\x20\x09]{0,32})?"
}


# What one request's grammar may cost, which its client controls: the per-step caps (a mask
# is computed for the sequence every step, on the engine's thread) at about half llguidance's
# defaults (~7 ms of lexer and ~1 ms of parser work a step at most), the lexer's states (1-2 kB
# each) and the grammar's size; errors name no part of the grammar or its state (they reach
# logs). A grammar past them is refused (400) or, mid-answer, ends it.
PARSER_LIMITS = llguidance.LLParserLimits(
    step_lexer_fuel=100_000,
    step_max_items=25_000,
    max_lexer_states=100_000,
    max_grammar_size=200_000,
    verbose_errors=False,
)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A request's grammar, compiled from what the client asked for (`compile_grammar`)."""

    grammar: str  # llguidance's grammar (its JSON form, from any kind)
    # Tokens of the answer generated before a resume (now the end of the resumed prompt): the
    # grammar reads them before the first new token.
    committed: tuple[int, ...] = ()


def compile_grammar(kind: Kind, value: Any) -> StructuredOutput:
    """The grammar for `value` of one kind; ValueError naming what is wrong with it.

    `json`: a JSON schema (an object, or its text); `regex`: a regular expression the whole
    answer matches; `choice`: a list of strings, the answer being one of them; `grammar`: a
    grammar in Lark's syntax (llguidance's dialect, whose `%json` and regex terminals it adds).
    """
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("a JSON schema must be an object")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("a regex must be a non-empty string")
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value)
        )
    elif kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a grammar must be a non-empty string")
        grammar = llguidance.LLMatcher.grammar_from_lark(value)
    else:
        raise ValueError(f"unknown structured output kind {kind!r}; one of {', '.join(KINDS)}")
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=PARSER_LIMITS)
    if error:
        raise ValueError(f"invalid {kind}: {error.strip()}")
    return StructuredOutput(grammar)


class Grammars:
    """Starts grammar states for an engine's sequences over its tokenizer (llguidance's view
    of the vocabulary, built on first use: about 0.2 s)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._eos = list(eos_token_ids) or list(tokenizer.eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def start(self, structured: StructuredOutput) -> GrammarState:
        """A new sequence's state, past the tokens it committed before a resume; ValueError for
        a grammar llguidance refuses or committed tokens it does not allow."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos
            )
        matcher = llguidance.LLMatcher(
            self._ll_tokenizer, structured.grammar, log_level=0, limits=PARSER_LIMITS
        )
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        state = GrammarState(matcher, self._vocab_size)
        if structured.committed and state.advance(list(structured.committed)) < len(
            structured.committed
        ):
            raise ValueError("the committed tokens do not follow the grammar")
        return state


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self._vocab_size = matcher, vocab_size

    @property
    def stopped(self) -> bool:
        """Whether the grammar takes no more tokens (but EOS): the answer is complete."""
        return self._matcher.is_stopped()

    def allowed(self, draft_ids: Sequence[int] = ()) -> torch.Tensor:
        """`[len(draft_ids) + 1, vocab]` bool: row j, the tokens allowed after the committed
        text and the first j drafts. Rows after a draft the grammar forbids repeat the row
        before it (that draft is always rejected, so they are never sampled from)."""
        valid = self._matcher.validate_tokens(list(draft_ids)) if draft_ids else 0
        rows = [self._mask()]
        read = 0
        for token in draft_ids[:valid]:
            # Once the grammar has stopped, EOS is the only token left, and llguidance does not
            # record reading it: a rollback would take a committed token back.
            if self._matcher.is_stopped():
                break
            self._matcher.consume_token(token)
            read += 1
            rows.append(self._mask())
        self.rollback(read)
        rows += rows[-1:] * (len(draft_ids) - read)
        return torch.stack(rows)

    def mask(self, logits: torch.Tensor, draft_ids: Sequence[int] = ()) -> torch.Tensor:
        """`logits` (`[len(draft_ids) + 1, vocab]`) with the tokens the grammar forbids at -inf,
        in place, on their device (the rows are built on the host, by llguidance). A row whose
        every allowed token was already at -inf (`min_tokens` holding off the EOS a finished
        grammar wants) gets its allowed tokens at 0: the grammar wins."""
        allowed = self.allowed(draft_ids).to(logits.device, non_blocking=True)
        vocab = logits.shape[-1]
        logits.masked_fill_(~allowed[:, :vocab], -math.inf)
        dead = torch.isneginf(logits.amax(dim=-1))
        if bool(dead.any()):
            logits[dead] = torch.where(allowed[dead, :vocab], 0.0, -math.inf)
        return logits

    def advance(self, tokens: Sequence[int]) -> int:
        """Read committed tokens; how many it took before the grammar stopped (all of them
        unless it stopped early). A token the grammar refuses ends it there too, with a
        warning: the masks should have ruled it out."""
        for n, token in enumerate(tokens):
            if self._matcher.is_stopped():
                return n
            if not self._matcher.consume_token(token):
                error = self._matcher.get_error()
                log.warning("grammar refused committed token %d: %s", token, error)
                return n
        return len(tokens)

    # For drafters, which walk the grammar over their own drafts and then step back.

    def try_advance(self, tokens: Sequence[int]) -> int:
        """Read tokens while the grammar takes them; how many it took (the state stays usable:
        a refused token is simply not read)."""
        return self._matcher.try_consume_tokens(list(tokens)) if tokens else 0

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the start, the grammar would take (reading none)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` read."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def _mask(self) -> torch.Tensor:
        """The allowed tokens now, unpacked from llguidance's bitmask (bit j of 32-bit word w,
        little-endian, is token 32 w + j)."""
        packed = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        bits = (packed.unsqueeze(1) >> _BITS) & 1
        return bits.view(-1)[: self._vocab_size].bool()


_BITS = torch.arange(8, dtype=torch.uint8)
