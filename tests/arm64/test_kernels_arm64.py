"""Our kernels built for AArch64 and run under qemu-user, against the plain-torch references and
against the x86 builds, from the same inputs (tests/arm64/cases.py, tests/arm64/cross.py).

- "neon" (any AArch64 CPU), on a Cortex-A72: every output within its reference's tolerance and
  bit for bit what x86's "avx512f" build computes (the same arithmetic, the same order).
- "neon_bf16_i8mm" (Armv8.6: Grace, Neoverse V1/V2), on qemu's `max` CPU with 128-bit and
  256-bit SVE vectors, and "sve256_bf16_i8mm" (Neoverse V1) with 256-bit ones: within
  tolerance everywhere; outside the bf16 dot products (BFDOT rounds as it goes, as x86's
  VDPBF16PS does, each its own way) bit for bit the avx512f build's; the quantized projections'
  integer dot products exact, so those outputs equal in every build.
"""

from __future__ import annotations

import pytest
import torch

from kernels import native_build
from tests.arm64 import cases
from tests.arm64.cross import Machine, Script, missing_tools

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
]

X86_BASELINE = Machine("x86 avx512f", "avx512f")
NEON = Machine("neon on cortex-a72", "neon", qemu_cpu="cortex-a72")
BF16_I8MM = [
    *(
        Machine(f"neon_bf16_i8mm on max, sve{bits}", "neon_bf16_i8mm", qemu_cpu=f"max,sve{bits}=on")
        for bits in (128, 256)
    ),
    Machine("sve256_bf16_i8mm on max, sve256", "sve256_bf16_i8mm", qemu_cpu="max,sve256=on"),
]


def _needs_avx512() -> None:
    if not native_build.runnable("avx512f"):
        pytest.skip("the x86 build to compare with needs an AVX512 CPU")


@pytest.fixture(scope="module")
def script() -> tuple[Script, list[cases.Case]]:
    return cases.kernel_script()


@pytest.fixture(scope="module")
def x86_outputs(script: tuple[Script, list[cases.Case]]) -> list[torch.Tensor]:
    _needs_avx512()
    return _run(X86_BASELINE, script)


def _run(machine: Machine, script: tuple[Script, list[cases.Case]]) -> list[torch.Tensor]:
    calls, all_cases = script
    results, outputs = machine.run(calls, [case.output for case in all_cases])
    assert results == [0] * len(results), f"{machine.name}: a kernel returned an error"
    return outputs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _differing(
    all_cases: list[cases.Case], got: list[torch.Tensor], want: list[torch.Tensor]
) -> list[str]:
    """The cases whose outputs are not the same bits."""
    pairs = zip(all_cases, got, want, strict=True)
    return [c.name for c, a, b in pairs if not torch.equal(_bits(a), _bits(b))]


def _check_references(
    machine: Machine, all_cases: list[cases.Case], outputs: list[torch.Tensor]
) -> None:
    for case, got in zip(all_cases, outputs, strict=True):
        rtol, atol = case.tolerance
        torch.testing.assert_close(
            got.double(),
            case.reference,
            rtol=rtol,
            atol=atol,
            msg=lambda m, c=case: f"{machine.name} {c.name}: {m}",
        )


def test_the_neon_build_matches_the_references_and_the_avx512f_builds_bits(
    script: tuple[Script, list[cases.Case]], x86_outputs: list[torch.Tensor]
) -> None:
    outputs = _run(NEON, script)
    _check_references(NEON, script[1], outputs)
    differ = _differing(script[1], outputs, x86_outputs)
    assert not differ, f"the neon build's bits differ from avx512f's in {differ}"


@pytest.mark.parametrize("machine", BF16_I8MM, ids=lambda m: m.name)
def test_the_bf16_i8mm_build_matches_the_references_and_differs_only_in_bf16_dots(
    machine: Machine, script: tuple[Script, list[cases.Case]], x86_outputs: list[torch.Tensor]
) -> None:
    outputs = _run(machine, script)
    _check_references(machine, script[1], outputs)
    dots = {c.name for c in script[1] if c.bf16_dot}
    differ = [name for name in _differing(script[1], outputs, x86_outputs) if name not in dots]
    assert not differ, (
        f"{machine.name} differs from avx512f outside the bf16 dot products: {differ}"
    )
    # BFDOT is in use: it rounds where the two fp32 FMAs do not, so some bf16 projection differs.
    assert set(_differing(script[1], outputs, x86_outputs)) & dots, (
        "no bf16 dot product differs: was the build's BFDOT used?"
    )


def test_the_x86_builds_run_the_same_script_within_the_references(
    script: tuple[Script, list[cases.Case]], x86_outputs: list[torch.Tensor]
) -> None:
    """The harness and the references themselves, on the builds the x86 tests already check."""
    _check_references(X86_BASELINE, script[1], x86_outputs)
    if native_build.runnable("avx512_bf16"):
        best = Machine("x86 avx512_bf16", "avx512_bf16")
        _check_references(best, script[1], _run(best, script))
