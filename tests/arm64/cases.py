"""Every kernel of kernels/csrc called on shapes that reach its tails, tiles and thread splits,
as one script (tests/arm64/cross.py), with each output's plain-torch reference in fp64."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import quant, quant_gguf
from kernels.quant import QuantizedWeight
from kernels.rotary import rope_cos_sin
from tests.arm64.cross import Buffer, Script
from tests.unit.test_attention import reference_attention

THREADS = 2
BF16_TOLERANCE = (2**-8, 1e-3)  # rtol, atol: tests/unit/test_native_kernels.py's for bf16
F32_TOLERANCE = (1e-5, 1e-5)
ATTENTION_BF16_TOLERANCE = (2e-2, 2e-2)  # tests/unit/test_attention.py's
QUANT_KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


@dataclass(frozen=True)
class Case:
    name: str
    output: Buffer
    reference: torch.Tensor  # fp64, the output's shape
    tolerance: tuple[float, float]  # rtol, atol
    bf16_dot: bool = False  # computed with bf16 dot products (BFDOT / VDPBF16PS round per pair)


def kernel_script(seed: int = 0) -> tuple[Script, list[Case]]:
    gen = torch.Generator().manual_seed(seed)
    script, cases = Script(), []
    _linear(script, cases, gen)
    _packed(script, cases, gen)
    _quantized(script, cases, gen)
    _norm_and_silu(script, cases, gen)
    _rotary(script, cases, gen)
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            _attention(script, cases, gen, dtype, head_dim)
    return script, cases


def randn(
    gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _linear(script: Script, cases: list[Case], gen: torch.Generator) -> None:
    # in 100: a tail of 4 past the 16- and 32-element chunks; out 37: a last block of one row.
    for dtype, kernel in (
        (torch.bfloat16, "outrider_linear_bf16"),
        (torch.float32, "outrider_linear_f32"),
    ):
        for rows, inn, out in ((1, 576, 37), (5, 100, 37), (9, 576, 8)):
            x, w, b = (
                randn(gen, rows, inn, dtype=dtype),
                randn(gen, out, inn, scale=0.05, dtype=dtype),
                randn(gen, out, dtype=dtype),
            )
            y = script.zeros(rows, out, dtype=dtype)
            script.call(
                kernel,
                script.tensor(x),
                script.tensor(w),
                script.tensor(b),
                y,
                rows,
                inn,
                out,
                THREADS,
            )
            expected = x.double() @ w.double().T + b.double()
            bf16 = dtype == torch.bfloat16
            tolerance = BF16_TOLERANCE if bf16 else F32_TOLERANCE
            cases.append(
                Case(f"{kernel}[{rows}x{inn}->{out}]", y, expected, tolerance, bf16_dot=bf16)
            )


def _packed(script: Script, cases: list[Case], gen: torch.Generator) -> None:
    for rows, inn, out in ((1, 96, 37), (9, 576, 70)):
        x, w, b = randn(gen, rows, inn), randn(gen, out, inn, scale=0.05), randn(gen, out)
        packed = script.zeros(-(-out // 16) * 16 * inn, dtype=torch.bfloat16)
        script.call("outrider_pack_bf16", script.tensor(w), packed, out, inn)
        y = script.zeros(rows, out, dtype=torch.bfloat16)
        script.call(
            "outrider_linear_packed",
            script.tensor(x),
            packed,
            script.tensor(b),
            y,
            rows,
            inn,
            out,
            THREADS,
        )
        expected = x.double() @ w.double().T + b.double()
        cases.append(
            Case(
                f"outrider_linear_packed[{rows}x{inn}->{out}]",
                y,
                expected,
                BF16_TOLERANCE,
                bf16_dot=True,
            )
        )


def quant_args(script: Script, weight: QuantizedWeight) -> tuple[object, ...]:
    """codes, scales, mins (or None), min_per_scale, bits of a quantized weight, as buffers."""
    args = weight.kernel_args()
    mins = None if weight.mins is None else script.tensor(weight.mins)
    return (
        script.tensor(weight.codes),
        script.tensor(weight.scales),
        mins,
        args.min_per_scale,
        args.bits,
    )


def _quantized(script: Script, cases: list[Case], gen: torch.Generator) -> None:
    for kind in QUANT_KINDS:
        for rows, inn, out in ((1, 576, 37), (9, 96, 20)):
            weight = quant_gguf.quantize(
                randn(gen, out, inn, scale=inn**-0.5, dtype=torch.float32), kind
            )
            for dtype in (torch.bfloat16, torch.float32):
                x, b = randn(gen, rows, inn, dtype=dtype), randn(gen, out, dtype=dtype)
                y = script.zeros(rows, out, dtype=dtype)
                script.call(
                    "outrider_linear_quant",
                    script.tensor(x),
                    int(dtype == torch.float32),
                    *quant_args(script, weight),
                    script.tensor(b),
                    y,
                    rows,
                    inn,
                    out,
                    THREADS,
                )
                expected = quant.reference_linear(x, weight, b).double()
                # The kernel and the reference differ in the order of their fp32 sums only.
                tolerance = (2**-7, 1e-2) if dtype == torch.bfloat16 else F32_TOLERANCE
                cases.append(
                    Case(
                        f"outrider_linear_quant[{kind},{dtype},{rows}x{inn}->{out}]",
                        y,
                        expected,
                        tolerance,
                    )
                )
        # Fused after the RMSNorm (with a residual) and after SwiGLU.
        rows, inn, out = 3, 96, 20
        values = randn(gen, out, inn, scale=inn**-0.5, dtype=torch.float32)
        weight = quant_gguf.quantize(values, kind)
        a, residual, norm_weight = randn(gen, rows, inn), randn(gen, rows, inn), randn(gen, inn)
        total, y = (
            script.zeros(rows, inn, dtype=torch.bfloat16),
            script.zeros(rows, out, dtype=torch.bfloat16),
        )
        script.call(
            "outrider_linear_quant_after",
            1,
            script.tensor(a),
            script.tensor(residual),
            script.tensor(norm_weight),
            1e-5,
            total,
            *quant_args(script, weight),
            None,
            y,
            rows,
            inn,
            out,
            THREADS,
        )
        normed = _rms_norm(a + residual, norm_weight, 1e-5).bfloat16()
        expected = quant.reference_linear(normed, weight, None).double()
        cases.append(Case(f"outrider_linear_quant_after[norm,{kind}]", y, expected, (2**-7, 1e-2)))
        gate_up = randn(gen, rows, 2 * inn, scale=2.0)
        y = script.zeros(rows, out, dtype=torch.bfloat16)
        script.call(
            "outrider_linear_quant_after",
            2,
            script.tensor(gate_up),
            None,
            None,
            0.0,
            None,
            *quant_args(script, weight),
            None,
            y,
            rows,
            inn,
            out,
            THREADS,
        )
        expected = quant.reference_linear(_silu_mul(gate_up).bfloat16(), weight, None).double()
        cases.append(Case(f"outrider_linear_quant_after[silu,{kind}]", y, expected, (2**-7, 1e-2)))


def _rms_norm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def _norm_and_silu(script: Script, cases: list[Case], gen: torch.Generator) -> None:
    for rows, dim in ((1, 576), (70, 100)):  # 70 rows: split between the threads
        x, residual, weight = (
            randn(gen, rows, dim, scale=3.0),
            randn(gen, rows, dim),
            randn(gen, dim),
        )
        out, total = (
            script.zeros(rows, dim, dtype=torch.bfloat16),
            script.zeros(rows, dim, dtype=torch.bfloat16),
        )
        script.call(
            "outrider_rms_norm_bf16",
            script.tensor(x),
            script.tensor(residual),
            script.tensor(weight),
            1e-5,
            out,
            total,
            rows,
            dim,
            THREADS,
        )
        summed = x + residual  # torch's bf16 add: the kernel's sum, bit for bit
        cases.append(
            Case(f"outrider_rms_norm_bf16[sum,{rows}x{dim}]", total, summed.double(), (0.0, 0.0))
        )
        cases.append(
            Case(
                f"outrider_rms_norm_bf16[{rows}x{dim}]",
                out,
                _rms_norm(summed, weight, 1e-5),
                BF16_TOLERANCE,
            )
        )
    for rows, inter in ((1, 1536), (70, 100)):
        gate_up = randn(gen, rows, 2 * inter, scale=4.0)
        gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
        out = script.zeros(rows, inter, dtype=torch.bfloat16)
        script.call(
            "outrider_silu_mul_bf16", script.tensor(gate_up), 2 * inter, rows, inter, out, THREADS
        )
        cases.append(
            Case(f"outrider_silu_mul_bf16[{rows}x{inter}]", out, _silu_mul(gate_up), (2**-8, 1e-6))
        )


def _rotary(script: Script, cases: list[Case], gen: torch.Generator) -> None:
    num_heads, kv_heads, head_dim, blocks, block_size = 9, 3, 64, 8, 16
    cos, sin = rope_cos_sin(head_dim, 4096, 10000.0)
    for tokens in (5, 70):
        qkv = randn(gen, tokens, (num_heads + 2 * kv_heads) * head_dim, scale=3.0)
        positions = torch.randint(0, 4096, (tokens,), generator=gen)
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        rows = script.tensor(qkv)
        k_cache = script.zeros(blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
        v_cache = script.zeros(blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
        script.call(
            "outrider_rotary_kv_bf16",
            rows,
            qkv.shape[1],
            tokens,
            num_heads,
            kv_heads,
            head_dim,
            script.tensor(positions),
            script.tensor(cos),
            script.tensor(sin),
            cos.shape[0],
            script.tensor(slots),
            blocks * block_size,
            k_cache,
            v_cache,
            THREADS,
        )
        heads = qkv.view(tokens, num_heads + 2 * kv_heads, head_dim).double()
        c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
        half = head_dim // 2
        lo, hi = heads[..., :half], heads[..., half:]
        rotated = torch.cat(
            [lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:]], -1
        )
        rotated[:, num_heads + kv_heads :] = heads[:, num_heads + kv_heads :]  # V is not rotated
        cases.append(
            Case(
                f"outrider_rotary_kv_bf16[{tokens}]",
                rows,
                rotated.reshape(tokens, -1),
                BF16_TOLERANCE,
            )
        )
        cache = torch.zeros(blocks * block_size, 2, kv_heads, head_dim, dtype=torch.float64)
        cache[slots] = rotated[:, num_heads:].reshape(tokens, 2, kv_heads, head_dim)
        shape = (blocks, block_size, kv_heads, head_dim)
        cases.append(
            Case(
                f"outrider_rotary_kv_bf16[{tokens},keys]",
                k_cache,
                cache[:, 0].reshape(shape),
                BF16_TOLERANCE,
            )
        )
        cases.append(
            Case(
                f"outrider_rotary_kv_bf16[{tokens},values]",
                v_cache,
                cache[:, 1].reshape(shape),
                (0.0, 0.0),
            )
        )


def _attention(
    script: Script, cases: list[Case], gen: torch.Generator, dtype: torch.dtype, head_dim: int
) -> None:
    """Three sequences (decode, a prefill chunk past a cached prefix, a draft of 5), their
    blocks shuffled among blocks nobody owns that hold large garbage."""
    num_heads, kv_heads, block_size = 6, 2, 16
    query_lens, seq_lens = [1, 20, 5], [37, 52, 16]
    widths = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(widths) + 5
    k = randn(gen, num_blocks, block_size, kv_heads, head_dim, scale=3.0, dtype=dtype)
    v = randn(gen, num_blocks, block_size, kv_heads, head_dim, scale=3.0, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(widths), dtype=torch.int32)
    at = 0
    for s, width in enumerate(widths):
        tables[s, :width] = torch.tensor(order[at : at + width])
        at += width
    q = randn(gen, sum(query_lens), num_heads, head_dim, dtype=dtype)
    out = script.zeros(sum(query_lens), num_heads, head_dim, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0)[:-1].tolist()], dtype=torch.int32)
    kernel = (
        "outrider_paged_attention_bf16"
        if dtype == torch.bfloat16
        else "outrider_paged_attention_f32"
    )
    scale = head_dim**-0.5
    script.call(
        kernel,
        script.tensor(q),
        num_heads * head_dim,
        script.tensor(k),
        script.tensor(v),
        script.tensor(tables),
        tables.shape[1],
        script.tensor(starts),
        script.tensor(torch.tensor(query_lens, dtype=torch.int32)),
        script.tensor(torch.tensor(seq_lens, dtype=torch.int32)),
        len(seq_lens),
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out,
        num_heads * head_dim,
        THREADS,
    )
    expected = torch.zeros(q.shape, dtype=torch.float64)
    for s, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = tables[s, : widths[s]].long()
        keys = k[rows].reshape(-1, kv_heads, head_dim)[:s_len].double()
        values = v[rows].reshape(-1, kv_heads, head_dim)[:s_len].double()
        first = int(starts[s])
        expected[first : first + q_len] = reference_attention(
            q[first : first + q_len].double(), keys, values, scale
        )
    bf16 = dtype == torch.bfloat16
    tolerance = ATTENTION_BF16_TOLERANCE if bf16 else F32_TOLERANCE
    cases.append(Case(f"{kernel}[head_dim {head_dim}]", out, expected, tolerance, bf16_dot=bf16))
