"""The head unrolled over a batch of training sequences, as EAGLE-3's training-time test runs it:
step 1 reads the target's fused features, step j > 1 reads the head's own output of step j - 1
and attends to its own earlier rows exactly as drafting does. `make_batch` gathers the rows a
batch trains on; workers/eagle/train.py scores the outputs, workers/eagle/trees.py measures
static draft trees with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.eagle.data import EagleData
from workers.eagle.head import EagleHead

# Rows inside the prompt are attended to but not scored: drafting happens in answers, and the
# LM head over every prompt row would cost a third of training.
PROMPT_WEIGHT = 0.0


@dataclass(slots=True)
class Batch:
    next_tokens: torch.Tensor  # [B, T] x_{i+1} for row i (0 where padded)
    features: torch.Tensor  # [B, T, F] target features at row i
    label_ids: torch.Tensor  # [B, T, K] draft-vocab indices of the target's top-k at i + 1, -1 out
    label_probs: torch.Tensor  # [B, T, K] their probabilities (0 where out of the draft vocab)
    row_weight: torch.Tensor  # [B, T] 0 for rows without a label, PROMPT_WEIGHT in the prompt
    answer_rows: torch.Tensor  # [B, T] bool, rows that draft answer tokens

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(getattr(self, name).to(device, non_blocking=True) for name in self.__slots__)
        )


def make_batch(data: EagleData, seqs: list[int], to_draft: torch.Tensor) -> Batch:
    lens = [data.sequence(s).stop - data.sequence(s).start for s in seqs]
    b, t = len(seqs), max(lens) - 1  # row i needs token i + 1
    k = data.top_ids.shape[1]
    next_tokens = torch.zeros(b, t, dtype=torch.int64)
    features = torch.zeros(b, t, data.features.shape[1], dtype=data.features.dtype)
    label_ids = torch.full((b, t, k), -1, dtype=torch.int64)
    label_lp = torch.full((b, t, k), -math.inf)
    row_weight = torch.zeros(b, t)
    answer_rows = torch.zeros(b, t, dtype=torch.bool)
    for n, (s, length) in enumerate(zip(seqs, lens, strict=True)):
        span = data.sequence(s)
        rows = length - 1
        next_tokens[n, :rows] = data.token_ids[span][1:]
        features[n, :rows] = data.features[span][:rows]
        ids = to_draft[data.top_ids[span][1:]]  # target distribution at position i + 1
        label_ids[n, :rows] = ids
        label_lp[n, :rows] = torch.where(ids >= 0, data.top_logprobs[span][1:], -math.inf)
        prompt = int(data.prompt_lens[s])
        row_weight[n, :rows] = PROMPT_WEIGHT
        row_weight[n, max(prompt - 1, 0) : rows] = 1.0  # row P - 1 drafts x_{P+1} onward
        answer_rows[n, max(prompt - 1, 0) : rows] = True
    # Renormalize the kept top-k inside the draft vocabulary; rows with nothing kept get no loss.
    label_probs = torch.softmax(label_lp, dim=-1).nan_to_num(0.0)
    row_weight = row_weight * (label_ids >= 0).any(-1)
    return Batch(
        next_tokens, features, label_ids.clamp(min=0), label_probs, row_weight, answer_rows
    )


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:  # [B, T, kvh, d] -> [B, h, T, d]
    return x.repeat_interleave(groups, dim=2).transpose(1, 2)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """Along dim 1, row i gets row i - by (zeros before the start)."""
    if by == 0:
        return x
    out = torch.zeros_like(x)
    out[:, by:] = x[:, :-by]
    return out


def unrolled_outputs(
    head: EagleHead, next_tokens: torch.Tensor, features: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """The head's outputs a `[B, T, hidden]` at each of `depth` unrolled drafting steps (draft
    logits are `head.draft_logits(a)`; the caller scores only the rows it needs).

    Step j (0-based) row i is the j-th draft of a chain that started from the target's feature
    at row i - j: it reads the head's output at row i - 1 of step j - 1, attends to step-0 keys
    at rows <= i - j and to the chain's own keys of steps 1..j (rows i - j + m for step m).
    """
    b, t, _ = features.shape
    cfg = head.config
    layer = head.midlayer
    attn = layer.self_attn
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    groups = nh // nkv
    rows = torch.arange(t, device=features.device)
    cos, sin = head.rope(rows, torch.float32).cos_sin()
    g = head.fuse_features(features.reshape(b * t, -1)).view(b, t, h)
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: k, v [B, h, T, d]
    outputs: list[torch.Tensor] = []
    inp = g
    for j in range(depth):
        x = head.layer_input(inp.reshape(b * t, h), next_tokens.reshape(-1))  # [B * T, 2h]
        attn_in, residual = layer.attention_input(x)
        qkv = F.linear(attn_in, attn.qkv_proj.weight).view(b, t, nh + 2 * nkv, hd)
        qk = (
            qkv[:, :, : nh + nkv] * cos[None, :, None]
            + _rotate(qkv[:, :, : nh + nkv]) * (sin[None, :, None])
        )
        q = qk[:, :, :nh].transpose(1, 2)  # [B, h, T, d]
        k_new = _expand_kv(qk[:, :, nh:], groups)
        v_new = _expand_kv(qkv[:, :, nh + nkv :], groups)
        keys.append((k_new, v_new))
        k0, v0 = keys[0]
        scores = [q @ k0.transpose(-1, -2) * attn.scale]  # [B, h, T, T]
        visible = rows[None, :] <= (rows[:, None] - j)
        scores[0] = scores[0].masked_fill(~visible, -math.inf)
        values = []
        for m in range(1, j + 1):  # the chain's own rows: step m at row i - (j - m)
            km, vm = keys[m]
            km, vm = _shift(km.transpose(1, 2), j - m), _shift(vm.transpose(1, 2), j - m)
            km, vm = km.transpose(1, 2), vm.transpose(1, 2)
            scores.append((q * km).sum(-1, keepdim=True) * attn.scale)  # [B, h, T, 1]
            values.append(vm)
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = probs[..., :t] @ v0
        for m, vm in enumerate(values):
            out = out + probs[..., t + m : t + m + 1] * vm
        out = out.transpose(1, 2).reshape(b * t, nh * hd)
        stream = residual + F.linear(out, attn.o_proj.weight)
        gate, up = F.linear(
            layer.post_attention_layernorm(stream), layer.mlp.gate_up_proj.weight
        ).split(layer.mlp.intermediate_size, dim=-1)
        a = (stream + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)).view(b, t, h)
        outputs.append(a)
        inp = _shift(a, 1)
    return outputs


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
