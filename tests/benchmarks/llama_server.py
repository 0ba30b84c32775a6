"""llama.cpp's `llama-server`, the peer the served benchmarks compare with.

Found on PATH, or built once from the llama.cpp sources inside the pinned `llama-cpp-python`
sdist (the same llama.cpp bench_quant runs through the Python binding), with this CPU's
instructions (`GGML_NATIVE`), into the user's cache. The build needs cmake and a C++ compiler,
and takes several minutes on two cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.benchmarks.bench_quant import LLAMA_CPP
from workers.model.gguf_loader import cache_root

BINARY = "llama-server"


def built_path() -> Path:
    version = LLAMA_CPP.split("==")[1]
    return cache_root() / f"llama.cpp-{version}" / "bin" / BINARY


def find(build: bool) -> Path | None:
    """The llama-server to run: on PATH, built before, or (with `build`) built now."""
    on_path = shutil.which(BINARY)
    if on_path is not None:
        return Path(on_path)
    target = built_path()
    if target.is_file():
        return target
    return _build(target) if build else None


def _build(target: Path) -> Path:
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (apt install cmake)")
    print(f"[llama-server] building from the {LLAMA_CPP} sdist (minutes)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", tmp, LLAMA_CPP],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        build = source / "build"
        options = {
            "CMAKE_BUILD_TYPE": "Release",
            "GGML_NATIVE": "ON",
            "LLAMA_CURL": "OFF",
            "LLAMA_OPENSSL": "OFF",
            "LLAMA_BUILD_TESTS": "OFF",
            "LLAMA_BUILD_EXAMPLES": "OFF",
            "LLAMA_BUILD_SERVER": "ON",
            "BUILD_SHARED_LIBS": "OFF",  # one file to keep
        }
        flags = [f"-D{name}={value}" for name, value in options.items()]
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *flags], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build), "--target", BINARY, "-j", jobs], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / BINARY, target)
    return target


def command(binary: Path, model: Path, port: int, threads: int, slots: int, ctx: int) -> list[str]:
    """llama-server on `model`: `slots` requests decoded together (its continuous batching),
    each with `ctx` tokens of context."""
    return [
        str(binary),
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--parallel", str(slots),
        "--ctx-size", str(slots * ctx),
        "--no-webui",
    ]  # fmt: skip
