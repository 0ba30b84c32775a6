"""EAGLE-3 heads in the published layout (config.json + weights, as the EAGLE authors, SpecForge,
vLLM and SGLang write them): a random head written here drafts what a reference forward,
implemented below from the layout's definition in plain torch, drafts; ours exported and read
back drafts the same; what does not fit the target is refused saying why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.factories import tiny_eagle_head, tiny_model
from tests.model.helpers import plain_tokens, run_staggered
from workers.drafting.base import DraftRequest
from workers.drafting.eagle import EagleDrafter
from workers.eagle.head import BUNDLED_HEAD
from workers.eagle.layout import is_eagle3_folder, load_folder, load_head, save_folder
from workers.engine.config import EngineConfig, RequestSpec, SpecConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_config
from workers.model.transformer import TransformerLM

GREEDY = SamplingParams(temperature=0.0)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, DRAFT_VOCAB = 32, 4, 2, 8, 40, 48


@pytest.fixture(scope="module")
def target() -> TransformerLM:
    return tiny_model(seed=3)


def published_head(
    target: TransformerLM, seed: int = 0, hidden: int = HIDDEN, **changes: object
) -> dict:  # type: ignore[type-arg]
    """A random head's config.json and tensors, as a trainer writes them (a head narrower than
    its target brings its own embedding)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size

    def rand(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    draft_ids = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": rand(hidden, 2 * target.config.hidden_size),
        "midlayer.input_layernorm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
        "midlayer.mlp.gate_proj.weight": rand(INTER, hidden),
        "midlayer.mlp.up_proj.weight": rand(INTER, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, INTER),
        "norm.weight": 1 + rand(hidden, scale=0.1),
        "lm_head.weight": rand(DRAFT_VOCAB, hidden, scale=2.0),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": target.config.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]},
    }
    config.update(changes)
    if hidden != target.config.hidden_size:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    return {"config": config, "tensors": tensors}


def write_folder(head: dict, path: Path, weights: str = "model.safetensors") -> Path:  # type: ignore[type-arg]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head["config"]))
    if weights.endswith(".safetensors"):
        save_file(head["tensors"], str(path / weights))
    else:
        torch.save(head["tensors"], path / weights)
    return path


def reference_drafts(
    head: dict,  # type: ignore[type-arg]
    target: TransformerLM,
    tokens: list[int],
    features: torch.Tensor,  # [n, 2 target hidden]: the target's states at positions 0..n-1
    k: int,
    norm_before_residual: bool = False,
) -> list[int]:
    """The layout's greedy chain, written from its definition: row i reads the embedding of
    tokens[i + 1] and the fused feature of position i, attends causally over the rows before
    it with rotary at its position; a draft's row reads the drafted token and the output of
    the row before; draft row r of the LM head is target token r + d2t[r]."""
    w, eps = head["tensors"], 1e-5
    embed = w.get("embed_tokens.weight", target.embed_tokens.weight.detach())

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x: torch.Tensor, pos: int) -> torch.Tensor:  # [heads, head_dim]
        half = HEAD_DIM // 2
        freqs = pos / 10000.0 ** (torch.arange(half).float() * 2 / HEAD_DIM)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def row(token: int, feature: torch.Tensor, pos: int) -> torch.Tensor:
        e = norm(embed[token], w["midlayer.input_layernorm.weight"])
        g = norm(feature, w["midlayer.hidden_norm.weight"])
        residual = g if norm_before_residual else feature
        x = torch.cat([e, g])
        q = (w["midlayer.self_attn.q_proj.weight"] @ x).view(HEADS, HEAD_DIM)
        keys.append(rotate((w["midlayer.self_attn.k_proj.weight"] @ x).view(KV_HEADS, -1), pos))
        values.append((w["midlayer.self_attn.v_proj.weight"] @ x).view(KV_HEADS, HEAD_DIM))
        q = rotate(q, pos)
        out = []
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            scores = torch.stack([key[kv] @ q[h] for key in keys]) / math.sqrt(HEAD_DIM)
            out.append(torch.softmax(scores, 0) @ torch.stack([v[kv] for v in values]))
        stream = residual + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(out)
        mlp_in = norm(stream, w["midlayer.post_attention_layernorm.weight"])
        gate, up = (
            w["midlayer.mlp.gate_proj.weight"] @ mlp_in,
            w["midlayer.mlp.up_proj.weight"] @ mlp_in,
        )
        return stream + w["midlayer.mlp.down_proj.weight"] @ (F.silu(gate) * up)

    g = features @ w["fc.weight"].T
    a = torch.zeros(HIDDEN)
    for i in range(features.shape[0]):
        a = row(tokens[i + 1], g[i], i)
    drafted = []
    for d in range(k):
        logits = w["lm_head.weight"] @ norm(a, w["norm.weight"])
        index = int(logits.argmax())
        token = index + int(w["d2t"][index])
        drafted.append(token)
        if d + 1 < k:
            a = row(token, a, features.shape[0] + d)
    return drafted


def drafts_of(
    drafter: EagleDrafter, tokens: list[int], features: torch.Tensor, k: int
) -> list[int]:
    drafter.add("a", tokens, GREEDY)
    drafter.observe_hidden("a", 0, features)
    draft = drafter.propose([DraftRequest("a", len(tokens), k)])["a"].token_ids
    drafter.remove("a")
    return draft


def features(target: TransformerLM, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2 * target.config.hidden_size, generator=gen)


@pytest.mark.parametrize(
    "variant",
    ["safetensors", "pytorch_model.bin", "own-embedding", "norm-before-residual", "narrower"],
)
def test_a_published_head_drafts_what_its_definition_says(target, variant: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    changes: dict[str, object] = {}
    if variant == "norm-before-residual":
        changes["norm_before_residual"] = True
    head = published_head(target, seed=1, hidden=24 if variant == "narrower" else HIDDEN, **changes)
    if variant == "own-embedding":
        head["tensors"]["embed_tokens.weight"] = torch.randn(target.config.vocab_size, HIDDEN)
    weights = "pytorch_model.bin" if variant == "pytorch_model.bin" else "model.safetensors"
    folder = write_folder(head, tmp_path / "head", weights)
    assert is_eagle3_folder(folder)
    loaded = load_head(folder, target.config)
    assert loaded.config.target_layers == (0, 1)
    drafter = EagleDrafter(loaded, target, num_blocks=32, block_size=4)
    for n, seed in ((1, 2), (6, 3), (13, 4)):
        tokens = torch.randint(0, 97, (n + 1,), generator=torch.Generator().manual_seed(seed))
        feats = features(target, n, seed)
        want = reference_drafts(
            head, target, tokens.tolist(), feats, 5, variant == "norm-before-residual"
        )
        assert drafts_of(drafter, tokens.tolist(), feats, 5) == want


@pytest.mark.parametrize(
    ("fields", "layers"),
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 0]}}, (1, 0)),  # SGLang: outputs
        (
            {"eagle_config": None, "eagle_aux_hidden_state_layer_ids": [1, 2]},
            (0, 1),
        ),  # vLLM: inputs
    ],
)
def test_both_spellings_of_the_target_layers(target, fields, layers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    head = published_head(target, **fields)
    loaded = load_head(write_folder(head, tmp_path / "head"), target.config)
    assert loaded.config.target_layers == layers


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target_hidden_size": 48}, "features of size 48"),
        ({"vocab_size": 100}, "vocabulary has 100 tokens"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5]}}, "outside the target's 2"),
        ({"num_hidden_layers": 2}, "more than one decoder layer"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "EAGLE-1/2"),
    ],
)
def test_a_head_that_does_not_fit_the_target_is_refused(target, fields, message, tmp_path) -> None:  # type: ignore[no-untyped-def]
    head = published_head(target, **fields)
    if "target_hidden_size" in fields:
        head["tensors"]["fc.weight"] = torch.randn(HIDDEN, 96)
    with pytest.raises(ValueError, match=message):
        load_head(write_folder(head, tmp_path / "head"), target.config)


def test_our_head_exported_and_read_back_drafts_the_same(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The LM head rows ours borrows from the target go into the folder as its own."""
    ours = tiny_eagle_head(target)
    save_folder(ours, tmp_path / "export", target.config)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    layers = list(ours.config.target_layers)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == layers
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in layers]
    again = load_folder(tmp_path / "export", target.config)
    assert again.own_lm_head is not None and again.config.target_layers == ours.config.target_layers
    first = EagleDrafter(ours, target, num_blocks=32, block_size=4)
    second = EagleDrafter(again, target, num_blocks=32, block_size=4)
    width = len(layers) * target.config.hidden_size
    for n in (1, 7, 12):
        tokens = list(range(5, 6 + n))
        feats = torch.randn(n, width, generator=torch.Generator().manual_seed(n))
        assert drafts_of(first, tokens, feats, 4) == drafts_of(second, tokens, feats, 4)


def test_greedy_output_with_a_published_head_equals_plain_decoding(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    head = load_head(write_folder(published_head(target, seed=5), tmp_path / "h"), target.config)
    drafter = EagleDrafter(head, target, num_blocks=256, block_size=4)
    spec = SpecConfig(num_speculative_tokens=4, adaptive=False)
    engine = LLMEngine(
        target, EngineConfig(max_model_len=128, spec=spec), drafters={"eagle": drafter}
    )
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = plain_tokens(target, (), prompts, params)
    assert run_staggered(engine, prompts, params, RequestSpec(method="eagle")) == want
    assert engine.stats.drafted > 0


def test_the_shipped_head_loads_for_the_bundled_model() -> None:
    """The head `make serve` drafts with is in the format this code reads, for the target it
    ships beside (a format change must retrain or convert it)."""
    target = load_config()
    head = load_head(BUNDLED_HEAD, target)
    assert head.config.target_hidden_size == target.hidden_size
    assert head.config.vocab_size == target.vocab_size
