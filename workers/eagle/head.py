"""An EAGLE-3-style draft head for a target model: features of three target layers in, tokens out.

For position i the target's hidden states after three of its layers (a low, a middle and a high
one) are normalized and fused into one feature g_i. The head's input row for position i is
`fc_in([norm(embed(x_{i+1})), norm(g_i)])`: the feature that predicted token i+1 together with
that token. One decoder layer (its own attention over earlier rows, rotary at position i) turns
it into a_i, and the target's own LM head, restricted to a draft vocabulary of the tokens the
target emits most (as FR-Spec does), predicts x_{i+2} from norm(a_i).

Drafting past the first token has no target feature yet: the head's own output a_i stands in
for g_{i+1}. Training unrolls exactly that (EAGLE-3's "training-time test"), so the head learns
from its own outputs. The embedding and LM head rows come from the target and are not stored:
a head file holds only the fusion, input and decoder-layer weights plus the draft vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kernels.attention import AttentionBackend, AttentionMetadata
from kernels.linear import WeightPacks
from kernels.quant import QuantizedWeight, Weight
from kernels.rotary import RotaryAngles, rope_cos_sin
from workers.model.config import ModelConfig
from workers.model.transformer import DecoderLayer, RMSNorm, TransformerLM

HEAD_FORMAT = "outrider-eagle3-v1"
# The head trained for the bundled SmolLM2-135M-Instruct (workers/eagle/train.py made it).
BUNDLED_HEAD = Path(__file__).parent / "weights" / "smollm2-135m-instruct-eagle3.safetensors"


@dataclass(frozen=True, slots=True)
class EagleConfig:
    target_name: str  # the target the head was trained for (checked at load)
    target_layers: tuple[int, ...]  # whose outputs are fused, low to high
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    draft_vocab_size: int

    def __post_init__(self) -> None:
        if len(self.target_layers) < 1:
            raise ValueError("an EAGLE head needs at least one target layer")
        if self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be positive")

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        target_layers: tuple[int, ...] | None = None,
        draft_vocab_size: int = 8192,
    ) -> EagleConfig:
        n = target.num_layers
        layers = target_layers or (1, n // 2, n - 1)
        if any(not 0 <= layer < n for layer in layers):
            raise ValueError(f"target layers {layers} out of range for a {n}-layer target")
        return cls(
            target_name=target.name,
            target_layers=tuple(layers),
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_positions=target.max_position_embeddings,
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
        )


class EagleHead(nn.Module):
    """The trainable head; `attach` borrows the target's embedding and LM head rows."""

    draft_vocab: torch.Tensor  # [draft vocab] target token id of each draft-vocabulary row

    def __init__(self, config: EagleConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        if draft_vocab.shape != (config.draft_vocab_size,):
            raise ValueError("draft_vocab needs draft_vocab_size token ids")
        self.config = config
        h = config.hidden_size
        self.fuse = nn.Linear(len(config.target_layers) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, config.rms_norm_eps)
        self.feature_norm = RMSNorm(h, config.rms_norm_eps)
        self.fc_in = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config.layer_config())
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.int64))
        # The target's token embedding, and the draft-vocabulary rows of its LM head: in their
        # quantized blocks where the target keeps them so.
        self.embed: Weight | None = None  # [target vocab, hidden]
        self.lm_head: Weight | None = None  # [draft vocab, hidden]
        self.packs = WeightPacks()
        self._cos, self._sin = rope_cos_sin(
            config.head_dim, config.max_positions, config.rope_theta
        )

    def init_weights(self, seed: int) -> None:
        """Fresh weights for training (the layer is built on the default device, not meta)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    def attach(self, target: TransformerLM) -> None:
        """Borrow the target's token embedding and the draft-vocabulary rows of its LM head."""
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError("the head's hidden size differs from the target's")
        if int(self.draft_vocab.max()) >= target.config.vocab_size:
            raise ValueError("the draft vocabulary has ids outside the target's vocabulary")
        embed, weight = target.embed_tokens.weight, target.lm_head_weight()
        self.embed = embed if isinstance(embed, QuantizedWeight) else embed.detach()
        rows = weight.index_select(0, self.draft_vocab.to(weight.device))
        self.lm_head = (
            rows if isinstance(rows, QuantizedWeight) else rows.detach().to(self.fuse.weight.dtype)
        )

    # -- the pieces, shared by drafting (paged cache) and training (dense, unrolled) -----------

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """`[n, len(target_layers) * hidden]` target hidden states → g `[n, hidden]`."""
        n, h = features.shape[0], self.config.hidden_size
        parts = features.to(self.fuse.weight.dtype).view(n, -1, h)
        parts = F.rms_norm(parts, (h,), eps=self.config.rms_norm_eps)  # layers differ in scale
        return self.packs.linear("fuse", parts.reshape(n, -1), self.fuse.weight)

    def layer_input(self, g: torch.Tensor, next_token_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None, "attach() the target first"
        if isinstance(self.embed, QuantizedWeight):
            e = self.embed.rows(next_token_ids, g.dtype).to(g.device)
        else:
            e = self.embed.index_select(0, next_token_ids).to(g.dtype)
        x = torch.cat([self.embed_norm(e), self.feature_norm(g)], dim=-1)
        return self.packs.linear("fc_in", x, self.fc_in.weight)

    def draft_logits(self, a: torch.Tensor) -> torch.Tensor:  # [n, draft vocab]
        assert self.lm_head is not None, "attach() the target first"
        return self.packs.linear("lm_head", self.norm(a), self.lm_head)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        if self._cos.device != positions.device:  # moved with the target (a GPU, say)
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return RotaryAngles(self._cos, self._sin, positions, dtype)

    def forward_paged(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] from layer_input
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:  # a, [num_tokens, hidden]
        angles = self.rope(positions, x.dtype)
        mlp, residual = self.layer(x, None, angles, kv_cache, meta, backend, backend.prepare(meta))
        return mlp + residual

    # -- files ---------------------------------------------------------------------------------

    def save(self, path: Path, extra: dict[str, str] | None = None) -> None:
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        metadata = {"format": HEAD_FORMAT, "config": json.dumps(asdict(self.config))}
        metadata.update(extra or {})
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32) -> EagleHead:
        metadata = head_metadata(path)
        if metadata.get("format") != HEAD_FORMAT:
            raise ValueError(f"{path} is not an Outrider EAGLE head ({HEAD_FORMAT})")
        raw = json.loads(metadata["config"])
        raw["target_layers"] = tuple(raw["target_layers"])
        config = EagleConfig(**raw)
        state = load_file(str(path))
        head = cls(config, torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        state = {k: v if k == "draft_vocab" else v.to(dtype) for k, v in state.items()}
        head.load_state_dict(state, strict=True, assign=True)
        return head.eval()


def head_metadata(path: Path) -> dict[str, str]:
    """The metadata a head file was saved with (format, config, training command, ...)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
