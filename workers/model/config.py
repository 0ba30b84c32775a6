"""The shape of a decoder-only transformer, however it was stored (GGUF or HF safetensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernels.rotary import RopeScaling
from workers.model.rope_config import read_rope, rope_parameters

# Each `model_type` we serve and its transformers class. All are llama's decoder: qwen2 adds
# q/k/v biases, qwen3 RMSNorm on each query and key head (and no biases), mistral a sliding
# window; any of them may scale its rotary frequencies (workers/model/rope_config.py).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# How a model's projection weights are held (`--quantization`, the deployment's
# `quantization`; workers/model/loader.py): auto: gguf for a GGUF file on a CPU that runs our
# kernels, else none; none: floats of the model's dtype; gguf: the file's quantized blocks
# as stored; int8: quantized at load to 8-bit blocks of 32 with an fp16 scale each (Q8_0).
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Llama-family model hyper-parameters (see ARCHITECTURES for what each type adds)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    name: str = ""
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (qwen3)
    rope_scaling: RopeScaling | None = None
    # Keys further back than this are masked (mistral). Contexts up to it attend to every key,
    # so a model with a window is served up to the window (`max_context`), exactly.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def max_context(self) -> int:
        """The longest context served: the model's, or its sliding window where shorter (past
        the window attention would skip keys, which our kernels do not)."""
        window = self.sliding_window or self.max_position_embeddings
        return min(self.max_position_embeddings, window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` (transformers 4.x or 5.x spelling)."""
        architecture = cfg.get("model_type", "")
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"config.json has model_type {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = read_rope(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            name=str(cfg.get("_name_or_path", "")),
            qk_norm=architecture == "qwen3",
            rope_scaling=rope.scaling,
            sliding_window=_sliding_window(architecture, cfg),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` that transformers and `from_hf_config` both read back."""
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters(self.rope_theta, self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "_name_or_path": self.name,
        }
        if self.architecture in ("llama", "mistral", "qwen3"):
            cfg["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            cfg["sliding_window"] = self.sliding_window
        elif self.architecture in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = self.sliding_window is not None
            cfg["sliding_window"] = self.sliding_window
            cfg["max_window_layers"] = 0 if self.sliding_window else self.num_layers
        return cfg


def _sliding_window(architecture: str, cfg: dict[str, Any]) -> int | None:
    """The window a config masks attention to, where it does (qwen's only with
    use_sliding_window, for the layers from max_window_layers on)."""
    window = cfg.get("sliding_window")
    if architecture in ("qwen2", "qwen3"):
        layers = int(cfg.get("max_window_layers", cfg.get("num_hidden_layers", 0)))
        uses = cfg.get("use_sliding_window") and layers < int(cfg.get("num_hidden_layers", 0))
        return int(window) if uses and window else None
    if architecture == "mistral" and window:
        return int(window)
    return None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
