"""EAGLE-3 head files: ours, and the folder layout the EAGLE authors, SpecForge, vLLM and SGLang
read and write, so a published head drafts here and a head trained here drafts there.

The published layout is a folder: `config.json` (a llama config naming `LlamaForCausalLMEagle3`,
with `draft_vocab_size`, `target_hidden_size`, `num_hidden_layers` 1, and which target layers
it fuses) and the weights (`model.safetensors`, or `pytorch_model.bin` as the EAGLE authors
ship them):

| tensor | shape | what |
| --- | --- | --- |
| `fc.weight` | [hidden, 3 target hidden] | fuses the target layers' states |
| `midlayer.input_layernorm.weight` | [hidden] | the embedding's norm |
| `midlayer.hidden_norm.weight` | [hidden] | the feature's norm |
| `midlayer.self_attn.{q,k,v}_proj.weight` | [heads * head_dim, 2 hidden] | attention over both |
| `midlayer.self_attn.o_proj`, `.post_attention_layernorm`, `.mlp.*` | | as llama's |
| `norm.weight`, `lm_head.weight` | [hidden], [draft vocab, hidden] | the head's own LM head |
| `d2t` | [draft vocab] int64 | draft row i is target token i + d2t[i] |
| `t2d` | [vocab] bool | which target tokens are in the draft vocabulary |
| `embed_tokens.weight` (optional) | [vocab, hidden] | otherwise the target's |

Which target layers: vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` as the inputs of
those layers (id j: the output of layer j - 1); SGLang reads `eagle_config.
eagle_aux_hidden_state_layer_ids` as layer outputs. With neither, both take the inputs of
layers 2, n // 2 and n - 3. We read either (the SGLang key where both are given) and write both.

Ours is one safetensors file holding the same tensors (the LM head left out where it is the
target's rows, as in a head we trained) with its config and training command in the metadata.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kernels.rotary import RopeScaling
from workers.eagle.head import EagleConfig, EagleHead, default_target_layers
from workers.model.config import ModelConfig
from workers.model.rope_config import read_rope, rope_parameters

log = logging.getLogger(__name__)

HEAD_FORMAT = "outrider-eagle3-v2"
LAYOUT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_eagle3_folder(path: Path) -> bool:
    """Whether `path` is a published-layout EAGLE-3 head (a folder whose config.json names
    one of LAYOUT_ARCHITECTURES)."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(a in LAYOUT_ARCHITECTURES for a in architectures)


def load_head(
    path: Path, target: ModelConfig | None = None, dtype: torch.dtype = torch.float32
) -> EagleHead:
    """A head from our file or a published folder, checked against `target` (which a folder
    needs: it may name its target layers only by the target's depth)."""
    if not path.is_dir():
        head = load_file_head(path, dtype, target)
    elif target is None:
        raise ValueError("a published EAGLE-3 head is read for a target: pass its config")
    else:
        head = load_folder(path, target, dtype)
    if target is not None:
        head.config.check_target(target)
    return head


# -- ours ----------------------------------------------------------------------------------------


def save_head(head: EagleHead, path: Path, extra: dict[str, str] | None = None) -> None:
    """Our file: the layout's tensors (no LM head where it is the target's) and metadata."""
    config = asdict(head.config)
    metadata = {"format": HEAD_FORMAT, "config": json.dumps(config)}
    metadata.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(layout_tensors(head), str(path), metadata=metadata)


def load_file_head(
    path: Path, dtype: torch.dtype = torch.float32, target: ModelConfig | None = None
) -> EagleHead:
    metadata = head_metadata(path)
    if metadata.get("format") != HEAD_FORMAT:
        raise ValueError(
            f"{path} is not an Outrider EAGLE head ({HEAD_FORMAT}, format "
            f"{metadata.get('format')!r}); a published EAGLE-3 head is a folder with config.json"
        )
    raw = json.loads(metadata["config"])
    raw["target_layers"] = tuple(raw["target_layers"])
    if raw.get("rope_scaling") is not None:
        scaling = dict(raw["rope_scaling"])
        scaling["freq_factors"] = tuple(scaling.get("freq_factors", ()))
        raw["rope_scaling"] = RopeScaling(**scaling)
    config = EagleConfig(**raw)
    if target is not None and target.max_context > config.max_positions:
        config = _with_positions(config, target.max_context)
    return from_layout_tensors(config, load_file(str(path)), dtype)


def head_metadata(path: Path) -> dict[str, str]:
    """The metadata a head file was saved with (format, config, training command, ...)."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# -- the published folder ------------------------------------------------------------------------


def load_folder(path: Path, target: ModelConfig, dtype: torch.dtype = torch.float32) -> EagleHead:
    cfg = json.loads((path / "config.json").read_text())
    config = config_from_layout(cfg, target)
    return from_layout_tensors(config, _read_weights(path), dtype)


def save_folder(head: EagleHead, path: Path, target: ModelConfig) -> None:
    """The head as a published-layout folder (its LM head the target's rows where it borrows
    them): config.json and model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    config = layout_config(head.config, target)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = layout_tensors(head, with_lm_head=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def config_from_layout(cfg: dict[str, Any], target: ModelConfig) -> EagleConfig:
    """Our config of a published head's config.json (speculators' nesting of the layer config
    under `transformer_layer_config` read too)."""
    layer = dict(cfg.get("transformer_layer_config") or cfg)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError("EAGLE-3 heads of more than one decoder layer are not supported")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ValueError("EAGLE-3 heads with attention or MLP biases are not supported")
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError("the head reads one hidden state (EAGLE-1/2); only EAGLE-3 heads serve")
    hidden = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    rope = read_rope(layer)
    return EagleConfig(
        target_name=str(cfg.get("target_name") or ""),
        target_layers=_target_layers(cfg, target.num_layers),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        vocab_size=int(cfg.get("vocab_size") or layer["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_positions=target.max_context,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer["vocab_size"]),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )


def _target_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The fused layers as outputs of layers (see the module docstring for the two keys)."""
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    if sglang and vllm and [int(i) + 1 for i in sglang] != [int(i) for i in vllm]:
        log.warning(
            "config.json names target layers %s (eagle_config, layer outputs) and %s "
            "(top level, layer inputs), which disagree; reading the first",
            sglang,
            vllm,
        )
    if sglang:
        layers = tuple(int(i) for i in sglang)
    elif vllm:
        layers = tuple(int(i) - 1 for i in vllm)
    else:
        layers = default_target_layers(num_layers)
    if any(not 0 <= i < num_layers for i in layers):
        raise ValueError(
            f"the head fuses target layers {list(layers)} (layer outputs), outside the "
            f"target's {num_layers} layers (the target's embedding, id 0 as an input, is not "
            "served)"
        )
    return layers


def layout_config(config: EagleConfig, target: ModelConfig) -> dict[str, Any]:
    """A config.json vLLM, SGLang and `config_from_layout` read alike."""
    layers = list(config.target_layers)
    return {
        "architectures": [LAYOUT_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": _rope_scaling(config),
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "norm_before_residual": config.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_ids) or None,
        "target_name": config.target_name,
    }


def _rope_scaling(config: EagleConfig) -> dict[str, Any] | None:
    if config.rope_scaling is None:
        return None
    params = rope_parameters(config.rope_theta, config.rope_scaling)
    params.pop("rope_theta")
    return params


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        file = path / name
        if file.is_file() and name.endswith(".safetensors"):
            return load_file(str(file))
        if file.is_file():
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} has none of {', '.join(_WEIGHT_FILES)}")


# -- tensors ---------------------------------------------------------------------------------------


def layout_tensors(head: EagleHead, with_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The head's weights under the layout's names (q/k/v and gate/up unfused)."""
    config, layer = head.config, head.midlayer
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    qw, kw, vw = layer.self_attn.qkv_proj.weight.detach().split([q, kv, kv])
    gate, up = layer.mlp.gate_up_proj.weight.detach().split(config.intermediate_size)
    vocab = head.draft_vocab.cpu()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    out = {
        "fc.weight": head.fc.weight,
        "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
        "midlayer.self_attn.q_proj.weight": qw,
        "midlayer.self_attn.k_proj.weight": kw,
        "midlayer.self_attn.v_proj.weight": vw,
        "midlayer.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.mlp.down_proj.weight,
        "norm.weight": head.norm.weight,
        "d2t": vocab - torch.arange(len(vocab)),
        "t2d": t2d,
    }
    if head.own_embed is not None:
        out["embed_tokens.weight"] = head.own_embed
    lm_head = head.own_lm_head if head.own_lm_head is not None else head.lm_head
    if head.own_lm_head is not None or with_lm_head:
        if not isinstance(lm_head, torch.Tensor):
            raise ValueError("attach() the target first: the LM head rows are the target's")
        out["lm_head.weight"] = lm_head
    return {name: t.detach().cpu().contiguous() for name, t in out.items()}


def from_layout_tensors(
    config: EagleConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> EagleHead:
    """A head of `config` with the layout's tensors (every one it needs, no other)."""
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    needed = set(layout_names())
    missing = sorted(needed - tensors.keys())
    optional = {"lm_head.weight", "embed_tokens.weight", "t2d"}
    unexpected = sorted(tensors.keys() - needed - optional)
    if missing or unexpected:
        raise ValueError(f"not an EAGLE-3 head: missing {missing[:5]}, unexpected {unexpected[:5]}")
    d2t = tensors["d2t"].to(torch.int64)
    vocab = d2t + torch.arange(len(d2t))
    if len(vocab) != config.draft_vocab_size:
        raise ValueError(
            f"d2t has {len(vocab)} rows; draft_vocab_size is {config.draft_vocab_size}"
        )
    head = EagleHead(config, vocab)
    state = {name: tensors[name] for name in needed if name != "d2t" and not _fused(name)}
    state["midlayer.self_attn.qkv_proj.weight"] = torch.cat(
        [tensors[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]
    )
    state["midlayer.mlp.gate_up_proj.weight"] = torch.cat(
        [tensors["midlayer.mlp.gate_proj.weight"], tensors["midlayer.mlp.up_proj.weight"]]
    )
    with torch.no_grad():
        for name, value in state.items():
            param = head.get_parameter(name)
            if param.shape != value.shape:
                raise ValueError(
                    f"{name} is {tuple(value.shape)}; the config makes it {tuple(param.shape)}"
                )
            param.copy_(value)
    if "lm_head.weight" in tensors:
        head.own_lm_head = tensors["lm_head.weight"]
    if "embed_tokens.weight" in tensors:
        head.own_embed = tensors["embed_tokens.weight"]
    return head.to(dtype).eval()


def _fused(name: str) -> bool:
    """Whether we hold `name` inside a fused projection (q/k/v, gate/up)."""
    return name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def layout_names() -> list[str]:
    """The tensors every head of the layout has."""
    layer = [
        "input_layernorm",
        "hidden_norm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    return ["fc.weight", "norm.weight", "d2t", *(f"midlayer.{n}.weight" for n in layer)]


def _with_positions(config: EagleConfig, positions: int) -> EagleConfig:
    return replace(config, max_positions=positions)
