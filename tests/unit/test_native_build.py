"""Which build of our kernels a CPU gets (kernels/native_build.py), on either architecture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernels import native_build


def _cpuinfo(key: str, flags: str) -> str:
    return f"processor\t: 0\n{key}\t: {' '.join(flags.split())}\nmodel name\t: -\n"


GRACE = _cpuinfo(  # Neoverse V2, as Linux lists its Features
    "Features",
    """fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt
    fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb
    paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm
    svebf16 i8mm bf16 dgh bti""",
)
GRAVITON3 = _cpuinfo(  # Neoverse V1: 256-bit SVE vectors
    "Features",
    """fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt
    fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca
    pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng""",
)
GRAVITON2 = _cpuinfo(  # Neoverse N1: Armv8.2 dot products, no BF16 or I8MM
    "Features", "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp ssbs"
)
SAPPHIRE_RAPIDS = _cpuinfo(
    "flags", "fpu sse2 avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16"
)
ICE_LAKE = _cpuinfo("flags", "fpu sse2 avx2 avx512f avx512bw avx512vl avx512_vnni")


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Set the machine and /proc/cpuinfo `build_variant` sees (its cached answer cleared)."""

    def set_cpu(machine: str, cpuinfo: str, forced: str | None = None) -> None:
        monkeypatch.setattr(native_build.platform, "machine", lambda: machine)
        monkeypatch.setattr(native_build, "cpu_flags", lambda: native_build.cpu_flags_of(cpuinfo))
        bits = 256 if cpuinfo is GRAVITON3 else 128 if " sve " in cpuinfo else 0
        monkeypatch.setattr(native_build, "sve_vector_bits", lambda: bits)
        if forced is None:
            monkeypatch.delenv(native_build.ENABLE_ENV, raising=False)
        else:
            monkeypatch.setenv(native_build.ENABLE_ENV, forced)
        native_build.build_variant.cache_clear()

    yield set_cpu
    native_build.build_variant.cache_clear()


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "forced", "variant"),
    [
        ("aarch64", GRACE, None, "neon_bf16_i8mm"),  # SVE2 at 128 bits: NEON's width
        ("aarch64", GRAVITON3, None, "sve256_bf16_i8mm"),
        ("aarch64", GRAVITON3, "neon", "neon"),
        ("aarch64", GRACE, "neon", "neon"),
        ("aarch64", GRAVITON2, None, "neon"),
        ("x86_64", SAPPHIRE_RAPIDS, None, "avx512_bf16"),
        ("x86_64", SAPPHIRE_RAPIDS, "avx512f", "avx512f"),
        ("x86_64", ICE_LAKE, None, "avx512f"),
    ],
)
def test_each_cpu_gets_the_best_build_it_can_run(cpu, machine, cpuinfo, forced, variant) -> None:  # type: ignore[no-untyped-def]
    cpu(machine, cpuinfo, forced)
    assert native_build.build_variant() == variant
    assert native_build.VARIANTS[variant][0] == machine
    flags = native_build.variant_flags(variant)
    assert "-fopenmp" in flags and ("-march=armv8.6-a+bf16+i8mm" in flags) == (
        variant == "neon_bf16_i8mm"
    )


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "forced", "reason"),
    [
        ("aarch64", GRACE, "avx512f", "not a build for aarch64"),
        ("x86_64", ICE_LAKE, "neon", "not a build for x86_64"),
        ("x86_64", "flags\t: fpu sse2 avx2\n", None, "this CPU lacks avx512f, avx512bw, avx512vl"),
        ("riscv64", "", None, "needs Linux on x86_64 or aarch64"),
        ("aarch64", GRACE, "yes", "takes 0, 1, avx512f or neon"),
    ],
)
def test_a_build_this_cpu_cannot_run_is_refused_with_the_reason(
    cpu, machine, cpuinfo, forced, reason
) -> None:  # type: ignore[no-untyped-def]
    cpu(machine, cpuinfo, forced)
    with pytest.raises(native_build.Unavailable, match=reason):
        native_build.build()
