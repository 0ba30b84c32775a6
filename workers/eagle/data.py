"""Training data for an EAGLE head, made by the target itself.

1. The target answers every training prompt (chat template) with our engine, batched: half of
   the prompts greedily, half sampled at temperature 0.8 with a per-prompt seed, so the head sees
   both the target's favourite continuations and some variety. The prompts come from two
   sources (`PROMPT_SOURCES`): the templates of `prompts.py` and the user turns the target wrote
   itself (`self_instruct.py`); each source's data is cached on its own and the two are joined.
2. Each prompt + answer is run through the target again in one forward that keeps the hidden
   states of the head's three target layers and the top-k of the target's next-token
   distribution at every position.

Everything is seeded; the result is one file of tensors (`EagleData`), a few hundred MB, cached
under $OUTRIDER_CACHE_DIR/eagle/.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner, SeqForward
from workers.engine.sampling_params import SamplingParams
from workers.kv_cache import PagedKVCache
from workers.model.tokenizer import Tokenizer
from workers.model.transformer import TransformerLM

TOP_K = 16  # target probabilities kept per position (the soft labels)


@dataclass(slots=True)
class EagleData:
    """Sequences laid end to end; `offsets[s]:offsets[s + 1]` are sequence s's positions."""

    token_ids: torch.Tensor  # [N] int64
    offsets: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int64 (loss only after the prompt)
    features: torch.Tensor  # [N, layers * hidden] bf16, target hidden states at each position
    top_ids: torch.Tensor  # [N, TOP_K] int64, the target's most likely next tokens
    top_logprobs: torch.Tensor  # [N, TOP_K] fp32, their log-probabilities
    target_layers: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "token_ids": self.token_ids,
                "offsets": self.offsets,
                "prompt_lens": self.prompt_lens,
                "features": self.features,
                "top_ids": self.top_ids,
                "top_logprobs": self.top_logprobs,
                "target_layers": list(self.target_layers),
            },
            path,
        )

    @classmethod
    def concat(cls, parts: Sequence[EagleData]) -> EagleData:
        layers = {p.target_layers for p in parts}
        if len(layers) != 1:
            raise ValueError(f"cannot join data of different target layers: {sorted(layers)}")
        if len(parts) == 1:
            return parts[0]  # no copy of a few GB for nothing
        starts = torch.tensor([0] + [int(p.offsets[-1]) for p in parts]).cumsum(0)
        shifted = [p.offsets[1:] + start for p, start in zip(parts, starts[:-1], strict=True)]
        return cls(
            token_ids=torch.cat([p.token_ids for p in parts]),
            offsets=torch.cat([starts[:1], *shifted]),
            prompt_lens=torch.cat([p.prompt_lens for p in parts]),
            features=torch.cat([p.features for p in parts]),
            top_ids=torch.cat([p.top_ids for p in parts]),
            top_logprobs=torch.cat([p.top_logprobs for p in parts]),
            target_layers=parts[0].target_layers,
        )

    @classmethod
    def load(cls, path: Path) -> EagleData:
        raw = torch.load(path, weights_only=True)
        raw["target_layers"] = tuple(raw["target_layers"])
        return cls(**raw)


def data_engine(
    target: TransformerLM, tokenizer: Tokenizer, max_model_len: int, max_num_seqs: int
) -> LLMEngine:
    """The batched engine that writes training text (answers, user turns): `max_num_seqs`
    sequences at a time (64 suits a CPU, a few hundred a GPU)."""
    return LLMEngine(
        target,
        EngineConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(1024, 4 * max_num_seqs),
        ),
        tokenizer=tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def prompts_per_chunk(max_num_seqs: int) -> int:
    """Prompts handed to one `generate()` call, which runs them to completion: enough for the
    engine to refill its batch as sequences finish."""
    return max(256, 4 * max_num_seqs)


def generate_answers(
    target: TransformerLM,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    max_tokens: int,
    seed: int,
    progress: bool = True,
    max_num_seqs: int = 64,
    deadline: float | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per prompt, from the target with our batched engine
    (`data_engine`); past `deadline` (`time.monotonic()`) no further chunk of prompts starts,
    and the answers so far are returned."""
    engine = data_engine(target, tokenizer, 1024, max_num_seqs)
    prompt_ids = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in prompts
    ]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0)
        if i % 2 == 0
        else SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed * 100_003 + i)
        for i in range(len(prompts))
    ]
    answers: list[tuple[list[int], list[int]]] = []
    batch = prompts_per_chunk(max_num_seqs)
    for start in tqdm(range(0, len(prompts), batch), desc="generate", disable=not progress):
        if start and deadline is not None and time.monotonic() > deadline:
            break
        done = engine.generate(prompt_ids[start : start + batch], params[start : start + batch])
        answers += [(c.prompt_token_ids, c.token_ids) for c in done]
    return answers


@torch.inference_mode()
def teacher_force(
    target: TransformerLM,
    sequences: Sequence[tuple[list[int], list[int]]],
    target_layers: tuple[int, ...],
    progress: bool = True,
    tokens_per_forward: int = 2048,
    deadline: float | None = None,
) -> EagleData:
    """Hidden states and top-k next-token log-probabilities at every position of each sequence
    (of those before `deadline`, `time.monotonic()`, where one is given: no forward starts
    after it).

    Consecutive sequences share a forward up to `tokens_per_forward` tokens of KV blocks (a
    longer one has a forward of its own). On an H100: 41 sequences/s one per forward, 84 packed
    into 2,048 tokens.
    """
    block_size = 16
    blocks = [-(-(len(p) + len(a)) // block_size) for p, a in sequences]
    num_blocks = max(max(blocks), tokens_per_forward // block_size)
    cache = PagedKVCache(target.config, num_blocks, block_size, target.dtype, target.device)
    runner = ModelRunner(target, cache)
    packs: list[list[int]] = []
    used = num_blocks
    for i, needed in enumerate(blocks):
        if used + needed > num_blocks:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += needed
    ids, feats, top_ids, top_lps = [], [], [], []
    offsets, prompt_lens = [0], []
    bar = tqdm(total=len(sequences), desc="features", disable=not progress)
    for n_pack, pack in enumerate(packs):
        if n_pack and deadline is not None and time.monotonic() > deadline:
            break
        forwards, first_block = [], 0
        for i in pack:
            tokens = sequences[i][0] + sequences[i][1]
            span = range(first_block, first_block + blocks[i])
            forwards.append(SeqForward(tokens, 0, span, num_logits=len(tokens)))
            first_block = span.stop
        out = runner.forward(forwards, hidden_layers=target_layers)
        top = torch.log_softmax(out.output.logits, dim=-1).topk(TOP_K, dim=-1)
        hidden = torch.cat([out.output.hidden_states[i] for i in target_layers], -1)
        for n, forward in enumerate(forwards):
            part = slice(*out.token_spans[n])  # every position is scored: logits rows match
            ids.append(torch.tensor(forward.token_ids))
            feats.append(hidden[part].bfloat16().cpu())
            top_ids.append(top.indices[part].cpu())
            top_lps.append(top.values[part].cpu())
            offsets.append(offsets[-1] + len(forward.token_ids))
            prompt_lens.append(len(sequences[pack[n]][0]))
        bar.update(len(pack))
    bar.close()
    return EagleData(
        token_ids=torch.cat(ids),
        offsets=torch.tensor(offsets),
        prompt_lens=torch.tensor(prompt_lens),
        features=torch.cat(feats),
        top_ids=torch.cat(top_ids),
        top_logprobs=torch.cat(top_lps),
        target_layers=target_layers,
    )


def draft_vocabulary(data: EagleData, size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often in the data (its argmax), most frequent
    first; ties and the unused remainder are filled by the next most likely tokens."""
    vocab_size = int(max(data.top_ids.max(), data.token_ids.max())) + 1
    counts = torch.bincount(data.top_ids[:, 0], minlength=vocab_size).double()
    # Second place onward breaks ties and ranks tokens the target never prefers outright.
    counts += 1e-3 * torch.bincount(data.top_ids[:, 1:].reshape(-1), minlength=vocab_size)
    return counts.argsort(descending=True)[:size].sort().values


PROMPT_SOURCES = ("templates", "self-instruct")


def source_prompts(source: str, seed: int) -> list[str]:
    """The training prompts of one source, in a seeded order."""
    from workers.eagle.prompts import training_prompts
    from workers.eagle.self_instruct import load_self_instruct_prompts

    if source == "templates":
        return training_prompts(seed)
    if source == "self-instruct":
        return load_self_instruct_prompts()
    raise ValueError(f"unknown prompt source {source!r}; expected one of {PROMPT_SOURCES}")


def default_data_path(seed: int, max_tokens: int, source: str = "templates") -> Path:
    """Where one source's data is cached; the self-instruct name carries a hash of its prompts,
    so a new prompt file never reuses old data."""
    from workers.model.gguf_loader import cache_root

    if source == "templates":
        return cache_root() / "eagle" / f"data-seed{seed}-max{max_tokens}.pt"
    digest = hashlib.sha256("\0".join(source_prompts(source, seed)).encode()).hexdigest()[:12]
    return cache_root() / "eagle" / f"data-{source}-{digest}-seed{seed}-max{max_tokens}.pt"


def build_data(
    target: TransformerLM,
    tokenizer: Tokenizer,
    target_layers: tuple[int, ...],
    seed: int,
    max_tokens: int,
    limit: int | None = None,
    progress: bool = True,
    source: str = "templates",
    max_num_seqs: int = 64,
) -> EagleData:
    prompts = source_prompts(source, seed)[:limit]
    torch.manual_seed(seed)
    answers = generate_answers(
        target, tokenizer, prompts, max_tokens, seed, progress, max_num_seqs=max_num_seqs
    )
    return teacher_force(target, answers, target_layers, progress)
