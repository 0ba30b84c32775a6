"""An EAGLE-3 draft head: features of three target layers in, tokens out, in the architecture
the EAGLE authors, SpecForge, vLLM and SGLang share (so heads move between them: layout.py).

For position i the target's hidden states after three of its layers (a low, a middle and a high
one, before any norm) are concatenated and fused by `fc` into one feature g_i. The head's
decoder layer reads the embedding of the token after position i, x_{i+1}, beside g_i: its
attention projects `[input_layernorm(embed(x_{i+1})), hidden_norm(g_i)]` (twice the hidden
size) to queries, keys and values, with rotary at position i, over the head's own earlier rows;
its residual stream starts from g_i itself (from hidden_norm(g_i) where the head's config says
`norm_before_residual`), then the MLP as in llama. Its output a_i (before the final norm) is
the head's next feature: `lm_head(norm(a_i))` over a draft vocabulary of the tokens the target
emits most (as FR-Spec does; `draft_vocab` maps each draft row to a target token) predicts
x_{i+2}.

Drafting past the first token has no target feature yet: a_i stands in for g_{i+1}. Training
unrolls exactly that (EAGLE-3's "training-time test"), so the head learns from its own outputs.

The token embedding is the target's unless the head brings its own; the LM head is the head's
own where its file has one (a published head), else the target's rows for the draft vocabulary
(the heads we train keep them frozen and do not store them).

Where each piece lives:

| what | where |
| --- | --- |
| the head, its config | this file |
| files: ours (one safetensors file) and the published folder (config.json + weights) | layout.py |
| `python -m workers.eagle.export` | export.py |
| training's unrolled forward | unroll.py |
| drafting over the paged cache: chain / tree, eager / graphed | workers/drafting/eagle*.py |
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.linear import WeightPacks
from kernels.quant import QuantizedWeight, Weight
from kernels.rotary import RopeScaling, RotaryAngles, rope_cos_sin
from workers.model.config import ModelConfig
from workers.model.transformer import MLP, Attention, DecoderLayer, RMSNorm, TransformerLM

# The head trained for the bundled SmolLM2-135M-Instruct (workers/eagle/train.py made it).
BUNDLED_HEAD = Path(__file__).parent / "weights" / "smollm2-135m-instruct-eagle3.safetensors"


@dataclass(frozen=True, slots=True)
class EagleConfig:
    target_name: str  # the target the head was trained for (informative)
    target_layers: tuple[int, ...]  # whose outputs are fused (0-based layer outputs), low to high
    target_hidden_size: int
    vocab_size: int  # the target's vocabulary, which the draft vocabulary maps into
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    draft_vocab_size: int
    rope_scaling: RopeScaling | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if len(self.target_layers) < 1:
            raise ValueError("an EAGLE head needs at least one target layer")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError("draft_vocab_size must be in 1..vocab_size")

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        target_layers: tuple[int, ...] | None = None,
        draft_vocab_size: int = 8192,
    ) -> EagleConfig:
        """A head of the target's own shape, fusing `target_layers` (default: those vLLM and
        SGLang capture when a head names none, `default_target_layers`)."""
        n = target.num_layers
        layers = target_layers or default_target_layers(n)
        if any(not 0 <= layer < n for layer in layers):
            raise ValueError(f"target layers {layers} out of range for a {n}-layer target")
        return cls(
            target_name=target.name,
            target_layers=tuple(layers),
            target_hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_positions=target.max_context,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
        )

    def layer_config(self) -> ModelConfig:
        """The head's decoder layer and KV cache as a one-layer model shape."""
        return ModelConfig(
            architecture="llama",
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            attention_bias=False,
            name="eagle-head",
            rope_scaling=self.rope_scaling,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a target this head cannot draft for, saying why."""
        problems = []
        if target.hidden_size != self.target_hidden_size:
            problems.append(
                f"it reads features of size {self.target_hidden_size}, the target's hidden size "
                f"is {target.hidden_size}"
            )
        if target.vocab_size != self.vocab_size:
            problems.append(
                f"its vocabulary has {self.vocab_size} tokens, the target's {target.vocab_size}"
            )
        if max(self.target_layers) >= target.num_layers:
            problems.append(
                f"it fuses layers {list(self.target_layers)} of a {target.num_layers}-layer target"
            )
        if problems:
            raise ValueError(f"the EAGLE head does not fit the target: {'; '.join(problems)}")


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The layers vLLM and SGLang capture for an EAGLE-3 head that names none (the inputs of
    layers 2, n // 2 and n - 3), as outputs of layers."""
    return (1, num_layers // 2 - 1, num_layers - 4) if num_layers >= 6 else (0, num_layers - 1)


class Eagle3Layer(nn.Module):
    """The head's decoder layer (published name `midlayer`): attention over
    `[input_layernorm(embedding), hidden_norm(feature)]`, residual from the feature."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        shape = config.layer_config()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(shape)
        self.self_attn.qkv_proj = nn.Linear(2 * h, shape.q_size + 2 * shape.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(shape)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input `[n, 2 hidden]`, the residual `[n, hidden]`) of head input
        rows `x = [embedding, feature]`."""
        h = x.shape[-1] // 2
        normed = self.hidden_norm(x[:, h:])
        residual = normed if self.norm_before_residual else x[:, h:]
        return torch.cat([self.input_layernorm(x[:, :h]), normed], dim=-1), residual

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, 2 hidden]: [embedding, feature]
        angles: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:  # a, [num_tokens, hidden], before the final norm
        attn_in, residual = self.attention_input(x)
        attn = self.self_attn
        qkv = attn.packs.linear("qkv", attn_in, attn.qkv_proj.weight)
        out = attn.attend(qkv, angles, kv_cache, meta, backend, plan)
        gate_up, residual = DecoderLayer._project_norm(
            self.post_attention_layernorm,
            out,
            residual,
            self.mlp.gate_up_proj,
            self.mlp.packs,
            "gate_up",
        )
        return self.mlp.down(gate_up) + residual


class EagleHead(nn.Module):
    """The head; `attach` borrows what it does not own of the target (see the module
    docstring)."""

    draft_vocab: torch.Tensor  # [draft vocab] target token id of each draft-vocabulary row
    own_lm_head: torch.Tensor | None  # [draft vocab, hidden], a published head's own
    own_embed: torch.Tensor | None  # [vocab, hidden], where a head brings its own

    def __init__(self, config: EagleConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        if draft_vocab.shape != (config.draft_vocab_size,):
            raise ValueError("draft_vocab needs draft_vocab_size token ids")
        self.config = config
        fused = len(config.target_layers) * config.target_hidden_size
        self.fc = nn.Linear(fused, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.int64))
        self.register_buffer("own_lm_head", None)
        self.register_buffer("own_embed", None)
        # What drafting reads: the embedding and the draft-vocabulary LM head rows, the
        # target's (in its quantized blocks where it keeps them so) unless the head owns them.
        self.embed: Weight | None = None  # [target vocab, hidden]
        self.lm_head: Weight | None = None  # [draft vocab, hidden]
        self.packs = WeightPacks()
        self._cos, self._sin = rope_cos_sin(
            config.head_dim, config.max_positions, config.rope_theta, scaling=config.rope_scaling
        )

    def init_weights(self, seed: int) -> None:
        """Fresh weights for training (built on the default device, not meta)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    def attach(self, target: TransformerLM) -> None:
        """Take the target's token embedding and draft-vocabulary LM head rows where the head
        has none of its own (after moving the head to the target's device and dtype)."""
        self.config.check_target(target.config)
        if int(self.draft_vocab.max()) >= target.config.vocab_size:
            raise ValueError("the draft vocabulary has ids outside the target's vocabulary")
        if self.own_embed is not None:
            self.embed = self.own_embed
        elif self.config.hidden_size != target.config.hidden_size:
            raise ValueError(
                f"the EAGLE head's hidden size ({self.config.hidden_size}) is not the target's "
                f"({target.config.hidden_size}) and it brings no embed_tokens of its own"
            )
        else:
            embed = target.embed_tokens.weight
            self.embed = embed if isinstance(embed, QuantizedWeight) else embed.detach()
        if self.own_lm_head is not None:
            self.lm_head = self.own_lm_head
            return
        weight = target.lm_head_weight()
        rows = weight.index_select(0, self.draft_vocab.to(weight.device))
        dtype = self.fc.weight.dtype
        self.lm_head = rows if isinstance(rows, QuantizedWeight) else rows.detach().to(dtype)

    # -- the pieces, shared by drafting (paged cache) and training (dense, unrolled) -----------

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """`[n, len(target_layers) * target hidden]` target hidden states → g `[n, hidden]`."""
        return self.packs.linear("fc", features.to(self.fc.weight.dtype), self.fc.weight)

    def layer_input(self, g: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        """The head's input rows `[n, 2 hidden]`: each token's embedding beside the feature
        `g` (`[n, hidden]`) of the position before it."""
        assert self.embed is not None, "attach() the target first"
        if isinstance(self.embed, QuantizedWeight):
            e = self.embed.rows(next_token_ids, g.dtype).to(g.device)
        else:
            e = self.embed.index_select(0, next_token_ids).to(g.dtype)
        return torch.cat([e, g], dim=-1)

    def draft_logits(self, a: torch.Tensor) -> torch.Tensor:  # [n, draft vocab]
        assert self.lm_head is not None, "attach() the target first"
        return self.packs.linear("lm_head", self.norm(a), self.lm_head)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        if self._cos.device != positions.device:  # moved with the target (a GPU, say)
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return RotaryAngles(self._cos, self._sin, positions, dtype)

    def forward_paged(
        self,
        x: torch.Tensor,  # [num_tokens, 2 hidden] from layer_input
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:  # a, [num_tokens, hidden]
        angles = self.rope(positions, x.dtype)
        return self.midlayer(x, angles, kv_cache, meta, backend, backend.prepare(meta))
