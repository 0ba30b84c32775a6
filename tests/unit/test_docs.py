"""docs/architecture.md stays true: every file it names exists, every class and function it
names is defined, and it stays a map (at most 300 lines)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("kernels", "workers", "cluster", "router", "load_tests", "tests")
FILE = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml|json|c|h))\b")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Z]\w*)\.(_?[a-z]\w*)$")  # Class.method
NAME = re.compile(r"^_?[a-z]+_\w+$|^[A-Z][a-z]+[A-Z]\w*$")  # snake_case or CamelCase


@cache
def sources() -> str:
    return "\n".join(
        path.read_text() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    )


def resolves(name: str) -> bool:
    """A repository path, or the tail of one (`engine/llm_engine.py`)."""
    if (ROOT / name).exists():
        return True
    return any(p.as_posix().endswith("/" + name) for p in ROOT.rglob(Path(name).name))


def defined(kind: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async )?{kind} {re.escape(name)}\b", sources(), re.M) is not None


def mentioned(name: str) -> bool:
    """Defined as a class or function, or at least a name in the code (a setting, say)."""
    if defined("def", name) or defined("class", name):
        return True
    return re.search(rf"\b{re.escape(name)}\b", sources()) is not None


def test_the_architecture_page_names_only_what_exists() -> None:
    text = ARCHITECTURE.read_text()
    files = set(FILE.findall(text))
    missing_files = sorted(f for f in files if not resolves(f))
    wrong: list[str] = []
    for code in set(CODE.findall(text)):
        if dotted := DOTTED.match(code):
            cls, member = dotted.groups()
            if not defined("class", cls) or not defined("def", member):
                wrong.append(code)
        elif NAME.match(code) and not mentioned(code):
            wrong.append(code)
    assert len(files) >= 40  # the page is a map: it names the files to read
    assert missing_files == [] and sorted(wrong) == []


def test_the_architecture_page_is_a_map() -> None:
    assert len(ARCHITECTURE.read_text().splitlines()) <= 300


def test_the_check_catches_a_wrong_name() -> None:
    assert resolves("engine/llm_engine.py") and not resolves("engine/no_such_file.py")
    assert defined("def", "step") and defined("class", "LLMEngine")
    assert not defined("class", "NoSuchEngine")
