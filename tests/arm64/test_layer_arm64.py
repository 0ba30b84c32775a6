"""The bundled model's first decoder layer (prefill, then a decode step over its cache) as
tests/arm64/harness.c runs it: on this host, the same bits as the model's own calls; under
qemu, the "neon" build gives the bits of x86's "avx512f" build and the "neon_bf16_i8mm" and
"sve256_bf16_i8mm" builds stay within bf16 tolerance of x86's "avx512_bf16" build (their bf16
attention scores round each in its own way)."""

from __future__ import annotations

import pytest
import torch

from kernels import native, native_build
from tests.arm64 import layer
from tests.arm64.cross import Buffer, Machine, Script, missing_tools

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
    pytest.mark.skipif(
        not native.available(), reason=f"no native kernels: {native.unavailable_reason()}"
    ),
]
NAMES = ["prefill MLP", "prefill stream", "decode MLP", "decode stream", "keys", "values"]


@pytest.fixture(scope="module")
def first_layer(quantized_checkpoint) -> layer.Layer:  # type: ignore[no-untyped-def]
    return layer.first_layer(quantized_checkpoint)


@pytest.fixture(scope="module")
def script(first_layer: layer.Layer) -> tuple[Script, list[Buffer]]:
    return layer.layer_script(first_layer)


def _run(machine: Machine, script: tuple[Script, list[Buffer]]) -> list[torch.Tensor]:
    results, outputs = machine.run(*script)
    assert results == [0] * len(results)
    return outputs


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[str]:
    return [
        n
        for n, x, y in zip(NAMES, a, b, strict=True)
        if not torch.equal(x.view(torch.int16), y.view(torch.int16))
    ]


def test_the_harness_runs_the_layer_as_the_model_does(
    first_layer: layer.Layer, script: tuple[Script, list[Buffer]]
) -> None:
    here = layer.layer_on_this_host(first_layer)
    assert not _same_bits(_run(Machine("this host", native_build.build_variant()), script), here)
    assert here[2].abs().max() > 0 and not any(t.isnan().any() for t in here)


def test_the_layer_under_emulation_matches_x86(script: tuple[Script, list[Buffer]]) -> None:
    if not native_build.runnable("avx512_bf16"):
        pytest.skip("the x86 builds to compare with need AVX512-BF16")
    baseline = _run(Machine("x86 avx512f", "avx512f"), script)
    neon = _run(Machine("neon on cortex-a72", "neon", qemu_cpu="cortex-a72"), script)
    assert not _same_bits(neon, baseline), "the neon build's layer differs from avx512f's"
    best = _run(Machine("x86 avx512_bf16", "avx512_bf16"), script)
    for machine in (
        Machine("neon_bf16_i8mm on max", "neon_bf16_i8mm", qemu_cpu="max,sve128=on"),
        Machine("sve256_bf16_i8mm on max", "sve256_bf16_i8mm", qemu_cpu="max,sve256=on"),
    ):
        for name, got, want in zip(NAMES, _run(machine, script), best, strict=True):
            torch.testing.assert_close(
                got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=f"{machine.name}: {name}"
            )
