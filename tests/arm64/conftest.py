"""The harness builds the tests here run, made once per session and side by side."""

from __future__ import annotations

import pytest

from kernels import native_build
from tests.arm64.cross import missing_tools, prepare


@pytest.fixture(scope="session", autouse=True)
def _harnesses() -> None:
    if missing_tools() is not None:
        return
    variants = ["neon", "neon_bf16_i8mm"]
    if all(f in native_build.cpu_flags() for f in native_build.REQUIRED_CPU_FLAGS["x86_64"]):
        variants.append("avx512f")
    if all(f in native_build.cpu_flags() for f in native_build.BEST["x86_64"][1]):
        variants.append("avx512_bf16")
    prepare(variants)
