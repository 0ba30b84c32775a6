"""The harness builds the tests here run, made once per session and side by side."""

from __future__ import annotations

import pytest

from kernels import native_build
from tests.arm64.cross import missing_tools, prepare


@pytest.fixture(scope="session", autouse=True)
def _harnesses() -> None:
    if missing_tools() is not None:
        return
    variants = [v for v, (arch, _) in native_build.VARIANTS.items() if arch == "aarch64"]
    variants += [v for v in ("avx512f", "avx512_bf16") if native_build.runnable(v)]
    prepare(variants)
