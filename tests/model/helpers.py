"""Driving our model directly over a paged cache, and an engine step by step, for tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.drafting.eagle import EagleDrafter
from workers.drafting.ngram import NgramConfig, NgramDrafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import load_head
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequential import SequentialEngine
from workers.engine.structured import Grammars
from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

# A structured-output case shared by the router and runtime tests: a question and a schema for
# its answer.
PERSON_QUESTION = "Bob is 41. Describe him as JSON."
NAME_AND_AGE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Two functions for the tool-calling tests (OpenAI's function definitions).
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


def make_runner(
    model: TransformerLM, num_blocks: int = 256, block_size: int = 16
) -> tuple[ModelRunner, BlockAllocator]:
    cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
    return ModelRunner(model, cache), BlockAllocator(num_blocks)


def prefill(
    runner: ModelRunner, table: BlockTable, tokens: Sequence[int], chunk: int = 1 << 30
) -> torch.Tensor:
    """Run `tokens` through the cache in chunks; logits of every token, in order."""
    logits = []
    for start in range(0, len(tokens), chunk):
        part = list(tokens[start : start + chunk])
        table.prepare_write(start, start + len(part))
        out = runner.forward([SeqForward(part, start, table.block_ids, num_logits=len(part))])
        logits.append(out.output.logits)
    return torch.cat(logits)


def all_logits(model: TransformerLM, tokens: Sequence[int]) -> torch.Tensor:
    """Logits of every position of `tokens` from one prefill in a fresh cache."""
    runner, alloc = make_runner(model, num_blocks=-(-len(tokens) // 16) + 1)
    return prefill(runner, BlockTable(alloc, 16), tokens)


def plain_tokens(
    model: TransformerLM,
    eos_token_ids: Sequence[int],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
) -> list[list[int]]:
    """Each prompt's tokens from plain decoding (`SequentialEngine`, a 512-token context): what
    the exactness tests hold every other path to."""
    plain = SequentialEngine(model, eos_token_ids=eos_token_ids, max_model_len=512)
    return [plain.generate(p, params).token_ids for p in prompts]


def run_staggered(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    spec: RequestSpec,
    gap: int = 2,
) -> list[list[int]]:
    """Request i (with `params`, or `params[i]`) arrives at step i * gap; each request's tokens
    in order."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] * gap <= step:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, each[i], spec)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return list(tokens.values())


def speculative_engine(
    method: str,
    model: TransformerLM,
    eos_token_ids: Sequence[int],
    tokenizer: Tokenizer | None = None,
    **config: int,
) -> LLMEngine:
    """An engine drafting with `ngram` (n-grams of 1 to 4) or `eagle` (the bundled head), four
    drafts a step whatever they cost (no adaptive k); `config`: other engine settings."""
    # With a tokenizer, EAGLE drafts within a request's grammar (structured output).
    grammars = None if tokenizer is None else Grammars(tokenizer, model.config.vocab_size, ())
    drafter = (
        NgramDrafter(NgramConfig(1, 4))
        if method == "ngram"
        else EagleDrafter(load_head(BUNDLED_HEAD), model, num_blocks=1024, grammars=grammars)
    )
    spec = SpecConfig(num_speculative_tokens=4, adaptive=False, disable_batch_size=64)
    return LLMEngine(
        model,
        EngineConfig(max_model_len=512, spec=spec, **config),  # type: ignore[arg-type]
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        drafters={method: drafter},
    )


# A prompt and the tokens fed after it (as decode steps or as drafts), for the row-independence
# check below; taken modulo a tiny model's vocabulary.
ROW_PROMPT = [1, 504, 3458, 314, 253, 4016, 1789, 30, 2, 198, 1, 9690, 198, 4982, 2444, 282, 4536]
ROW_NEW = [338, 1085, 3145, 411, 260, 4413]


def assert_logits_independent_of_forward(model: TransformerLM, block_size: int = 16) -> None:
    """A token's logits are the same bits however its forward was made up: alone in a decode
    step, inside a verification of drafts beside another sequence's prompt chunk, or in a
    prompt chunk after a cached prefix (what speculation's and the prefix cache's exactness
    rest on)."""
    vocab = model.config.vocab_size
    prompt = [t % vocab for t in ROW_PROMPT]
    new = [t % vocab for t in ROW_NEW]
    tokens = prompt + new
    cache = PagedKVCache(model.config, 8, block_size, model.dtype, model.device)
    runner = ModelRunner(model, cache)
    blocks = [0, 1]  # the sequence under test
    other = [4, 5]  # a second sequence sharing some forwards

    def logits_of(forwards: list[SeqForward]) -> list[torch.Tensor]:
        output = runner.forward(forwards)
        return [output.logits_of(i).clone() for i in range(len(forwards))]

    def prefill() -> torch.Tensor:  # the whole prompt at once; every position's row
        (rows,) = logits_of([SeqForward(prompt, 0, blocks, len(prompt))])
        return rows

    whole = prefill()
    stepped = [whole[-1:]]  # decode steps: one new token a forward
    for j, token in enumerate(new):
        (row,) = logits_of([SeqForward([token], len(prompt) + j, blocks)])
        stepped.append(row)
    prefill()
    verified, _ = logits_of(
        [SeqForward(new, len(prompt), blocks, len(new)), SeqForward(tokens[::-1][:20], 0, other, 3)]
    )
    # The prompt in two chunks, then the new tokens: every position scored.
    (first,) = logits_of([SeqForward(tokens[:7], 0, blocks, 7)])
    (rest,) = logits_of([SeqForward(tokens[7:], 7, blocks, len(tokens) - 7)])
    chunked = torch.cat([first, rest])
    assert torch.equal(whole, chunked[: len(prompt)])
    for j in range(len(new)):  # row j scores the position after new[j]
        assert torch.equal(stepped[j + 1][0], verified[j]), j
        assert torch.equal(stepped[j + 1][0], chunked[len(prompt) + j]), j
