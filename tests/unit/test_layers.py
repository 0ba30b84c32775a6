"""The layers of the code (docs/architecture.md): kernels <- workers <- cluster <- router <-
load_tests. A module imports only from its own layer and those below it, at the top of a file or
inside a function alike; the test reads every import statement of every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "workers", "cluster", "router", "load_tests")
GENERATED = ("router/proto/generate_pb2",)


def imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of each absolute import in a module."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def against_the_layers(layer: str, source: str, path: str) -> list[str]:
    """Each import of `source` (a module of `layer`) from a layer above it."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return [
        f"{path}:{line} imports {package}"
        for line, package in imported_packages(ast.parse(source))
        if package in rank and rank[package] > rank[layer]
    ]


def test_no_module_imports_from_a_layer_above_it() -> None:
    wrong: list[str] = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if not name.startswith(GENERATED):
                wrong += against_the_layers(layer, path.read_text(), name)
    assert wrong == []


def test_the_check_sees_imports_inside_functions() -> None:
    source = (
        "import torch\n"
        "from workers.engine import config\n"
        "def serve():\n"
        "    from router.server import Router\n"
        "    import cluster.runtime\n"
    )
    assert against_the_layers("workers", source, "x.py") == [
        "x.py:4 imports router",
        "x.py:5 imports cluster",
    ]
    assert against_the_layers("router", source, "x.py") == []


MAX_LINES = 500  # one concern a file (the developers' guide)
SOURCES = (*LAYERS, "tests")


def test_no_source_file_is_longer_than_500_lines() -> None:
    """Every Python module and C source of the code and its tests, generated code aside."""
    too_long = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            name = path.relative_to(ROOT).as_posix()
            if path.suffix not in (".py", ".c", ".h") or name.startswith(GENERATED):
                continue
            num_lines = path.read_text().count("\n")
            if num_lines > MAX_LINES:
                too_long.append(f"{name}: {num_lines} lines")
    assert too_long == []
