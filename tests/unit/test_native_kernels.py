"""Our C kernels (kernels/native.py) against plain-torch references; the fallback without them."""

from __future__ import annotations

import pytest
import torch

from kernels import linear as linear_module
from kernels import native, native_build
from kernels.linear import AMX_MAX_ROWS, NATIVE_MAX_ROWS, WeightPacks, linear, pack

needs_native = pytest.mark.skipif(
    not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
needs_amx = pytest.mark.skipif(not native.amx_available(), reason="no AMX tiles here")


def _bf16(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


@needs_native
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 576, 960),
        (2, 64, 5),
        (3, 33, 577),
        (4, 1000, 96),
        (7, 1536, 64),
        (9, 96, 13),
        (70, 200, 37),  # more rows than one tile of the kernel (ROW_TILE = 32)
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_matches_an_fp64_reference(
    rows: int, in_features: int, out_features: int, with_bias: bool, dtype: torch.dtype
) -> None:
    """The unpacked kernel's bf16 build (linear_bf16) and its fp32 one (linear_f32)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = _bf16(rows, in_features, gen=gen).to(dtype)
    w = _bf16(out_features, in_features, gen=gen, scale=in_features**-0.5).to(dtype)
    b = _bf16(out_features, gen=gen).to(dtype) if with_bias else None
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    kernel = native.linear_bf16 if dtype == torch.bfloat16 else native.linear_f32
    out = kernel(x, w, b)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    # fp32 sums (rounded once to bf16 in bf16: within 2^-8 relative of the exact value), plus
    # the fp32 summation's far smaller error.
    rtol, atol = (2**-8, 1e-3) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)
    # No worse than torch's own matmul in that dtype.
    theirs = (x @ w.T + (0 if b is None else b)).double()
    slack = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert (out.double() - expected).abs().max() <= (theirs - expected).abs().max() + slack


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_gives_each_row_the_same_bits_whatever_the_batch_and_threads(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(7)
    x = _bf16(40, 200, gen=gen).to(dtype)  # past one tile of rows (ROW_TILE = 32)
    w = _bf16(123, 200, gen=gen, scale=0.1).to(dtype)
    b = _bf16(123, gen=gen).to(dtype)
    kernel = native.linear_bf16 if dtype == torch.bfloat16 else native.linear_f32
    together = kernel(x, w, b)
    for r in range(x.shape[0]):
        assert torch.equal(kernel(x[r : r + 1], w, b)[0], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x, w, b), together)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kernel", ["linear_bf16", "linear_packed"])
def test_projections_round_their_fp32_sums_to_nearest_even_as_torch_does(kernel: str) -> None:
    """The last step of every kernel, fp32 -> bf16 (VCVTNEPS2BF16, or integer instructions in the
    avx512f build): one product `a * 1` plus a bias `b` makes the fp32 sum a + b, whose rounding
    must match torch's, ties (to even), overflow to infinity and NaN included."""
    gen = torch.Generator().manual_seed(3)
    a = _bf16(4096, gen=gen, scale=4.0)
    b = _bf16(4096, gen=gen, scale=4.0)
    # Exact ties: a + 2^(e-8) sits halfway between two bf16 neighbours of a (e: a's exponent).
    ties = torch.tensor([1.0, 1.0078125, -3.0, 96.0]).bfloat16()
    half_steps = torch.tensor([2**-8, 2**-8, -(2**-7), 0.25]).bfloat16()
    big = torch.tensor([3e38, -3e38, float("nan"), float("inf")]).bfloat16()
    a = torch.cat([a, ties, big])
    b = torch.cat([b, half_steps, big])
    rows = a.shape[0]
    x = torch.zeros(rows, 32, dtype=torch.bfloat16)
    x[:, 0] = a
    w = torch.zeros(1, 32, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    packed = native.pack_bf16(w)
    for r in range(rows):  # one output per call: the bias is the row's own b
        bias = b[r : r + 1].contiguous()
        if kernel == "linear_bf16":
            got = native.linear_bf16(x[r : r + 1], w, bias)[0, 0]
        else:
            got = native.linear_packed(x[r : r + 1], packed, 1, bias)[0, 0]
        want = (a[r].float() + b[r].float()).bfloat16()
        assert got.view(torch.int16) == want.view(torch.int16) or (got.isnan() and want.isnan())


@needs_native
def test_linear_bf16_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = _bf16(2, 64, gen=gen), _bf16(8, 64, gen=gen)
    with pytest.raises(TypeError):
        native.linear_bf16(x.float(), w)
    with pytest.raises(ValueError, match="shapes"):
        native.linear_bf16(x, _bf16(8, 32, gen=gen))
    with pytest.raises(ValueError, match="contiguous"):
        native.linear_bf16(x, _bf16(64, 8, gen=gen).T)
    with pytest.raises(ValueError, match="bias"):
        native.linear_bf16(x, w, _bf16(7, gen=gen))


# The kernels over a packed weight: AVX512 dot products anywhere, AMX tiles where the CPU has them.
PACKED_KERNELS = [
    pytest.param("linear_packed", marks=needs_native),
    pytest.param("linear_amx", marks=needs_amx),
]


@pytest.mark.parametrize("kernel", PACKED_KERNELS)
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 576, 960),
        (2, 64, 5),  # one partial block of outputs
        (5, 1536, 200),  # AVX512: 5 rows take tiles of 4 blocks; 13 blocks, a partial group
        (7, 96, 577),  # AVX512: tiles of 3 blocks, the last output alone in its block
        (9, 1024, 40),  # AVX512: a tile of 8 rows and one of 1
        (16, 96, 40),  # AMX: one full tile of rows
        (17, 576, 33),
        (300, 64, 48),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_projections_match_an_fp64_reference(
    kernel: str, rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = _bf16(rows, in_features, gen=gen)
    w = _bf16(out_features, in_features, gen=gen, scale=in_features**-0.5)
    b = _bf16(out_features, gen=gen) if with_bias else None
    expected = x.double() @ w.double().T + (0 if b is None else b.double())
    out = getattr(native, kernel)(x, native.pack_bf16(w), out_features, b)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)
    theirs = (x @ w.T + (0 if b is None else b)).double()
    assert (out.double() - expected).abs().max() <= (theirs - expected).abs().max() + 1e-2


@pytest.mark.parametrize("kernel", PACKED_KERNELS)
def test_packed_projections_give_each_row_the_same_bits_whatever_the_batch_and_threads(
    kernel: str,
) -> None:
    project = getattr(native, kernel)
    gen = torch.Generator().manual_seed(8)
    # 40 rows: tiles of 8 rows (AVX512) or three of 16 (AMX), the last partial; alone, a row
    # takes AVX512 tiles of 4 blocks instead of 3.
    x = _bf16(40, 128, gen=gen)
    w = _bf16(70, 128, gen=gen, scale=0.1)  # an odd number of 16-output blocks, the last partial
    b = _bf16(70, gen=gen)
    packed = native.pack_bf16(w)
    together = project(x, packed, 70, b)
    for r in range(x.shape[0]):
        assert torch.equal(project(x[r : r + 1], packed, 70, b)[0], together[r])
    assert torch.equal(project(x[3:12], packed, 70, b), together[3:12])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(project(x, packed, 70, b), together)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_packing_refuses_what_it_cannot_pack() -> None:
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_bf16(_bf16(16, 40, gen=gen))
    with pytest.raises(TypeError):
        native.pack_bf16(torch.zeros(16, 32))
    packed = native.pack_bf16(_bf16(16, 64, gen=gen))
    with pytest.raises(ValueError, match="does not fit"):
        native.linear_packed(_bf16(1, 32, gen=gen), packed, 16)
    if native.amx_available():
        with pytest.raises(ValueError, match="does not fit"):
            native.linear_amx(_bf16(1, 32, gen=gen), packed, 16)
    assert pack(_bf16(16, 40, gen=gen)) is None  # linear keeps its other paths for it
    assert pack(torch.zeros(16, 32)) is None


@needs_native
def test_weight_packs_follow_their_weights_and_linear_uses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With AMX, packed weights go to the AMX kernel for up to AMX_MAX_ROWS rows; without, to
    `linear_packed` for any number."""
    calls: list[int] = []
    kernel = "linear_amx" if native.amx_available() else "linear_packed"
    real = getattr(native, kernel)

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(native, kernel, spy)
    gen = torch.Generator().manual_seed(4)
    w = _bf16(48, 64, gen=gen)
    packs = WeightPacks()
    first = packs.get("w", w)
    assert first is not None and packs.get("w", w) is first and packs.nbytes() == 48 * 64 * 2
    x = _bf16(AMX_MAX_ROWS + 1, 64, gen=gen)
    for rows in (1, 16, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        out = linear(x[:rows], w, None, packs.get("w", w))
        torch.testing.assert_close(
            out.double(), x[:rows].double() @ w.double().T, rtol=2e-2, atol=2e-2
        )
    if native.amx_available():
        assert calls == [1, 16, AMX_MAX_ROWS]
    else:
        assert calls == [1, 16, AMX_MAX_ROWS, AMX_MAX_ROWS + 1]
    with torch.no_grad():
        w.mul_(2)  # changed in place: the old pack no longer fits, and a new one is made
    assert not first.fits(w)
    second = packs.get("w", w)
    assert second is not None and second is not first
    torch.testing.assert_close(
        linear(x[:2], w, None, first).double(), x[:2].double() @ w.double().T, rtol=2e-2, atol=2e-2
    )  # a stale pack handed in anyway is ignored
    assert packs.get("w", w.float()) is None  # fp32: nothing to pack


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70: split between threads
@pytest.mark.parametrize("dim", [576, 100])  # 100: a tail shorter than a vector
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bf16_matches_an_fp64_reference(rows: int, dim: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    x = _bf16(rows, dim, gen=gen, scale=3.0)
    residual = _bf16(rows, dim, gen=gen) if with_residual else None
    weight = _bf16(dim, gen=gen)
    eps = 1e-5
    out, total = native.rms_norm_bf16(x, weight, eps, residual)
    # The sum is torch's bf16 add, bit for bit.
    assert torch.equal(total, x if residual is None else x + residual)
    s = total.double()
    expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-3)
    for r in (0, rows - 1):  # a row's result does not depend on the batch
        alone = native.rms_norm_bf16(
            x[r : r + 1], weight, eps, None if residual is None else residual[r : r + 1]
        )[0]
        assert torch.equal(alone[0], out[r])


@needs_native
def test_linear_sends_bf16_and_fp32_rows_to_the_native_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, int]] = []

    def spy(name: str) -> object:
        real = getattr(native, name)

        def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> object:
            calls.append((name, x.shape[0]))
            return real(x, w, b)

        return kernel

    for name in ("linear_bf16", "linear_f32"):
        monkeypatch.setattr(native, name, spy(name))
    gen = torch.Generator().manual_seed(1)
    w = _bf16(32, 64, gen=gen)
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 40):
        linear(_bf16(rows, 64, gen=gen), w)  # no packed weight: not the AMX kernel
    linear(_bf16(1, 64, gen=gen), w, use_native=False)
    bf16 = [rows for name, rows in calls if name == "linear_bf16"]
    if native.variant() == "avx512_bf16":  # torch's own bf16 GEMM past a few rows
        assert bf16 == [1, NATIVE_MAX_ROWS]
    else:  # torch emulates bf16 here: ours takes every row count
        assert bf16 == [1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 40]
    calls.clear()
    for rows in (1, 5, 300):  # fp32: ours at every row count (row-independent)
        linear(torch.randn(rows, 64), w.float())
    linear(torch.randn(1, 64), w.float(), use_native=False)
    linear(torch.randn(1, 64, requires_grad=True), w.float())  # autograd: torch's
    assert calls == [("linear_f32", 1), ("linear_f32", 5), ("linear_f32", 300)]


def test_without_the_native_kernels_torch_computes_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OUTRIDER_NATIVE_KERNELS=0 (or a CPU or machine without them): torch's kernels run."""
    monkeypatch.setenv(native_build.ENABLE_ENV, "0")
    native_build.load_library.cache_clear()
    try:
        assert not native.available()
        assert native.unavailable_reason() == f"{native_build.ENABLE_ENV}=0"
        with pytest.raises(RuntimeError, match="unavailable"):
            native.linear_bf16(torch.zeros(1, 32).bfloat16(), torch.zeros(4, 32).bfloat16())
        gen = torch.Generator().manual_seed(2)
        x, w = _bf16(3, 64, gen=gen), _bf16(16, 64, gen=gen)
        expected = x.double() @ w.double().T
        torch.testing.assert_close(linear(x, w).double(), expected, rtol=2e-2, atol=2e-2)
    finally:
        monkeypatch.delenv(native_build.ENABLE_ENV)
        native_build.load_library.cache_clear()
    assert linear_module.native is native


@needs_native
def test_the_bf16_model_computes_the_same_with_and_without_native_kernels(
    checkpoint,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode and verify steps of the bundled model in bf16: the native path picks the greedy
    tokens torch's kernels do and is as close to the fp32 model as they are (two bf16 paths
    differ from each other by both their roundings, so each is held to fp32 instead)."""
    from workers.engine.model_runner import ModelRunner, SeqForward
    from workers.kv_cache import BlockAllocator, BlockTable, PagedKVCache
    from workers.model.loader import build_model

    model = build_model(checkpoint, dtype=torch.bfloat16)
    prompt = checkpoint.tokenizer.encode("The capital of France is Paris. The capital of Italy is")

    def logits() -> torch.Tensor:
        cache = PagedKVCache(model.config, 8, 16, model.dtype, model.device)
        table = BlockTable(BlockAllocator(8), 16)
        table.prepare_write(0, len(prompt))
        runner = ModelRunner(model, cache)
        runner.forward([SeqForward(prompt[:-3], 0, table.block_ids)])
        rows = [runner.forward([SeqForward(prompt[-3:-2], len(prompt) - 3, table.block_ids)])]
        rows.append(  # a two-token verify step
            runner.forward([SeqForward(prompt[-2:], len(prompt) - 2, table.block_ids, 2)])
        )
        return torch.cat([r.logits_of(0) for r in rows])

    with torch.inference_mode():
        ours = logits()
        monkeypatch.setattr(native, "available", lambda: False)
        theirs = logits()
        model = build_model(checkpoint, dtype=torch.float32)
        exact = logits()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    def cosine(a: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.float(), exact, dim=-1).min())

    assert cosine(ours) > 0.999
    assert cosine(ours) >= cosine(theirs) - 5e-4


@needs_native
def test_paged_attention_refuses_what_it_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = _bf16(4, 16, 2, 64, gen=gen)
    query, out = _bf16(1, 6, 64, gen=gen), torch.empty(1, 6, 64, dtype=torch.bfloat16)
    tables = (torch.zeros(1, 1, dtype=torch.int32),) + (torch.tensor([0], dtype=torch.int32),) * 2
    lens = torch.tensor([5], dtype=torch.int32)

    def call(q: torch.Tensor, k: torch.Tensor, o: torch.Tensor, *ints: torch.Tensor) -> None:
        native.paged_attention(q, k, k, *(ints or (*tables, lens)), 0.125, o)

    assert native.paged_attention_problem(query, cache, cache) is None
    with pytest.raises(ValueError, match="bf16"):
        call(query.float(), cache, out)
    with pytest.raises(ValueError, match="unsupported shape"):
        call(_bf16(1, 6, 48, gen=gen), _bf16(4, 16, 2, 48, gen=gen), torch.empty(1, 6, 48))
    with pytest.raises(ValueError, match="unsupported shape"):
        call(_bf16(1, 5, 64, gen=gen), cache, torch.empty(1, 5, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="KV cache must be contiguous"):
        call(query, _bf16(4, 2, 16, 64, gen=gen).transpose(1, 2), out)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        call(_bf16(1, 64, 6, gen=gen).transpose(1, 2), cache, out)
    with pytest.raises(ValueError, match="query's shape"):
        call(query, cache, torch.empty(2, 6, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="int32"):
        call(query, cache, out, tables[0].long(), *tables[1:], lens)
