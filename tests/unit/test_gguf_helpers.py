"""GGUF name mapping and the inverse of llama.cpp's Q/K permutation."""

from __future__ import annotations

import pytest
import torch

from workers.model.gguf_loader import hf_name, unpermute_qk


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K rows (written from its description)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize(("rows", "heads"), [(576, 9), (192, 3), (16, 2)])
def test_unpermute_inverts_llama_cpp_permutation(rows: int, heads: int) -> None:
    w = torch.randn(rows, 5)
    torch.testing.assert_close(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    b = torch.randn(rows)
    torch.testing.assert_close(unpermute_qk(llama_cpp_permute(b, heads), heads), b)


def test_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")
