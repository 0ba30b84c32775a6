"""Small builders shared by tests: a tiny random model (config, weights), an EAGLE head for it,
and paged-cache helpers."""

from __future__ import annotations

import torch

from workers.eagle.head import EagleConfig, EagleHead
from workers.model.config import ModelConfig
from workers.model.transformer import TransformerLM


def tiny_config(architecture: str = "llama", **overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "architecture": architecture,
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": architecture == "llama",
        "attention_bias": architecture == "qwen2",
        "qk_norm": architecture == "qwen3",
        "eos_token_ids": (1,),
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names for `config`."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    w = {
        "model.embed_tokens.weight": rand(config.vocab_size, h),
        "model.norm.weight": 1 + rand(h),
    }
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = rand(config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1 + rand(h)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h)
        w[p + "self_attn.q_proj.weight"] = rand(q, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, q)
        w[p + "mlp.gate_proj.weight"] = rand(i, h)
        w[p + "mlp.up_proj.weight"] = rand(i, h)
        w[p + "mlp.down_proj.weight"] = rand(h, i)
        if config.attention_bias:
            for x, n in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{x}_proj.bias"] = rand(n)
        if config.qk_norm:
            for x in "qk":
                w[p + f"self_attn.{x}_norm.weight"] = 1 + rand(config.head_dim)
    return w


def tiny_model(seed: int, **overrides: object) -> TransformerLM:
    """A tiny llama with random weights, in eval mode."""
    config = tiny_config(**overrides)
    model = TransformerLM(config)
    model.load_hf_weights(random_hf_weights(config, seed=seed))
    return model.eval()


def tiny_eagle_head(target: TransformerLM, draft_vocab: int = 64, seed: int = 0) -> EagleHead:
    """A random EAGLE head for `target` over `draft_vocab` of its tokens, attached to it."""
    config = EagleConfig.for_target(target.config, draft_vocab_size=draft_vocab)
    vocab = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    head = EagleHead(config, vocab[:draft_vocab].sort().values)
    head.init_weights(seed)
    with torch.no_grad():  # larger weights than training starts from: decisive argmaxes
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(10)
    head.attach(target)
    return head.eval()


def scattered_block_ids(num_tokens: int, block_size: int, num_blocks: int, seed: int) -> list[int]:
    """Enough distinct blocks for `num_tokens`, in a random order across the cache."""
    needed = -(-num_tokens // block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return perm[:needed].tolist()
