"""The offline GPU check (tests/gpu_check.py) as a GPU host runs it, tried on the CPU: with Ray,
FastAPI, Redis and OpenTelemetry unimportable (a lent GPU machine has none of them), it collects
and runs every CUDA test module (each skips here) and writes its files and table; and no module
with CUDA tests is left out of its list."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_check import CUDA_TEST_MODULES, NOT_ON_ONE_GPU, ROOT

# What a lent GPU machine lacks, made unimportable in the check's processes (sitecustomize runs
# at every interpreter's start, the pytest the check starts included).
BLOCKER = """
import sys

MISSING = {"ray", "fastapi", "redis", "opentelemetry", "uvicorn", "starlette"}


class NotOnAGpuHost:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r} (not on a GPU host)")
        return None


sys.meta_path.insert(0, NotOnAGpuHost())
"""


def test_every_module_with_cuda_tests_is_checked() -> None:
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if path != Path(__file__) and re.search(r"mark\.cuda\b|needs_cuda", path.read_text())
    }
    assert marked == set(CUDA_TEST_MODULES) | set(NOT_ON_ONE_GPU)


@pytest.mark.slow
def test_the_check_runs_without_ray_fastapi_redis_or_opentelemetry(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    blocked = subprocess.run(
        [sys.executable, "-c", "import ray"], env=env, capture_output=True, text=True
    )
    assert "not on a GPU host" in blocked.stderr  # the blocker is in force
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_check", "--out", str(out), "--only", "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (out / "check.log").read_text() if (out / "check.log").is_file() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "check.json",
        "check.log",
        "pytest.xml",
        "summary.md",
    ]
    tests = json.loads((out / "check.json").read_text())["parts"]["tests"]
    assert tests["errors"] == 0 and tests["failures"] == 0 and tests["tests"] > 50
    assert tests["skipped"] == tests["tests"]  # no GPU here: each skips, none fails to import
    assert "| tests | ok |" in (out / "summary.md").read_text()
