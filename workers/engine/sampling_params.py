"""Per-request decoding settings, validated where they enter."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kernels.penalties import apply_penalties, position_counts
from kernels.sampling import logits_to_probs
from workers.engine.logprobs import MAX_LOGPROBS
from workers.engine.structured import GrammarState, StructuredOutput


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Temperature 0 is greedy decoding."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one that appears
    # Each generated token's log-probability and this many alternatives (0: none besides it);
    # None: no log-probabilities (workers/engine/logprobs.py)
    logprobs: int | None = None
    # The same for each prompt token after the first (vLLM's `prompt_logprobs`): the prompt is
    # computed whole, without the prefix cache, its every position scored
    prompt_logprobs: int | None = None
    # Penalties on tokens already seen (kernels/penalties.py), applied before temperature:
    # repetition over prompt and output (1: off), frequency and presence over the output (0: off)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's
    # vLLM's: only these tokens may be generated (empty: any)
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's `bad_words`, as token sequences: the output never holds one (a sequence's last
    # token is ruled out where the output ends with the rest of it)
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # EOS and stop tokens are held off until this many tokens (vLLM's)
    # A grammar the answer follows (workers/engine/structured.py); the engine holds each
    # sequence's place in it and hands that to `adjust`, which applies its masks last
    structured: StructuredOutput | None = None
    # Special tokens (those the tokenizer marks so) left out of the text, as vLLM's
    # `skip_special_tokens`; EOS and stop tokens are left out either way
    skip_special_tokens: bool = True
    # vLLM's: the stop string, or the stop token's (or EOS's) text, that ends the text stays in it
    include_stop_str_in_output: bool = False
    # OpenAI's predicted output, as token ids: a hint for speculation only (drafters that copy
    # text also copy from it, workers/drafting/ngram.py `Prediction`); what is sampled never
    # depends on it
    prediction: tuple[int, ...] = ()
    # The root of the request's prefix-cache hash chain (vLLM's `cache_salt`, as a number):
    # requests share cached KV blocks only with requests of the same salt (0: the common one)
    cache_salt: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not word for word in self.bad_words):
            raise ValueError("bad words must not be empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def end_token_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end an answer: its stop tokens, and the model's EOS unless ignored."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)

    @property
    def adjusts_beyond_penalties(self) -> bool:
        """Whether `adjust` does more than penalize: a bias, or a mask (allowed tokens, bad
        words, `min_tokens`, a grammar) that may leave a row no token."""
        return (
            bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or bool(self.bad_words)
            or self.min_tokens > 0
            or self.structured is not None
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust` changes the logits before the sampling transform."""
        return self.penalized or self.adjusts_beyond_penalties

    def adjust(
        self,
        logits: torch.Tensor,  # [len(draft_ids) + 1, vocab]
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        draft_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
        grammar: GrammarState | None = None,
        penalize: bool = True,
    ) -> torch.Tensor:  # [len(draft_ids) + 1, vocab] fp32 on the logits' device
        """These settings' changes to the logits of a verify forward's rows, row j being the
        position after the output so far and the first j drafts: penalties, then the logit
        bias, then the tokens outside `allowed_token_ids` and those that would complete a bad
        word ruled out, then, at positions short of `min_tokens`, EOS and the stop tokens, then
        what `grammar` (the sequence's place in `structured`) forbids. Done where the logits
        are (a GPU's included): the host builds only small index tensors, each change is one
        write. `penalize=False`: the penalties were applied already (the engine applies them
        for a whole step at once: workers/engine/penalty_rows.py)."""
        vocab, device = logits.shape[-1], logits.device

        def ids(values: Iterable[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.long, device=device)

        logits = logits.float()
        if self.penalized and penalize:
            in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_prompt[ids(prompt_ids)] = True
            logits = apply_penalties(
                logits,
                position_counts(output_ids, draft_ids, vocab, device),
                in_prompt,
                self.repetition_penalty,
                self.frequency_penalty,
                self.presence_penalty,
            )
        else:
            logits = logits.clone()
        if self.logit_bias:
            tokens, biases = zip(*self.logit_bias, strict=True)
            bias = torch.tensor(biases, dtype=logits.dtype, device=device)
            logits.index_add_(1, ids(tokens), bias.expand(logits.shape[0], -1))
        if self.allowed_token_ids:
            outside = torch.ones(vocab, dtype=torch.bool, device=device)
            outside[ids(self.allowed_token_ids)] = False
            logits.masked_fill_(outside, -math.inf)
        banned = [  # (row, token): the token would complete a bad word after that row's output
            (row, word[-1])
            for row in (range(logits.shape[0]) if self.bad_words else ())
            for word in self.bad_words
            if _ends_with([*output_ids, *draft_ids[:row]], word[:-1])
        ]
        if banned:
            rows, tokens = ids(t for pair in banned for t in pair).view(-1, 2).T
            logits[rows, tokens] = -math.inf
        short = self.min_tokens - len(output_ids)  # rows whose token would come too early
        if short > 0:
            ends = {*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids)}
            if ends:
                logits[:short, ids(sorted(ends))] = -math.inf
        if grammar is not None:
            grammar.mask(logits, draft_ids)
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [vocab] or [1, vocab] -> [1, vocab]
        """These settings' sampling transform of one position's logits, in fp32 on the host,
        for the draws made there: a remote prefill's first token (`sample_one`), the reference
        engine, a model drafter's q. A batch's rows go to the engine's `Sampler` instead
        (workers/engine/sampler.py), which works on the device on a GPU."""
        return logits_to_probs(
            logits.float().cpu().view(1, -1),
            torch.tensor([self.temperature], dtype=torch.float32),
            torch.tensor([self.top_k], dtype=torch.long),
            torch.tensor([self.top_p], dtype=torch.float32),
            torch.tensor([self.min_p], dtype=torch.float32),
        )


def _ends_with(output: Sequence[int], suffix: Sequence[int]) -> bool:
    """Whether `output` ends with `suffix` (an empty suffix: always)."""
    n = len(suffix)
    return n == 0 or (len(output) >= n and list(output[-n:]) == list(suffix))
