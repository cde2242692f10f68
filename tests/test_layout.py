"""The test tree's layout: what test modules share lives in tests/helpers/, never in another test module."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

TESTS = ROOT / "tests"


def imported_modules(path: Path) -> set[str]:
    """The absolute name of every module ``path`` imports (``from . import x`` resolved against its package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else ())
            module = ".".join(p for p in (base, node.module or "") if p)
            if node.module is None or module == "tests":  # ``from tests import helpers``: the names are modules
                names.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                names.add(module)
    return names


def helper(name: str) -> bool:
    return name == "tests.helpers" or name.startswith("tests.helpers.")


def test_test_modules_import_only_the_helpers() -> None:
    """A test module imports another test module's model or fit through tests/helpers/ only: each test module then
    runs, moves and is read on its own."""
    wrong = {}
    for path in sorted(TESTS.rglob("*.py")):
        names = [n for n in sorted(imported_modules(path)) if n.split(".")[0] == "tests" and not helper(n)]
        if names:
            wrong[str(path.relative_to(ROOT))] = names
    assert not wrong, f"test modules importing other test modules (move what they share into tests/helpers/): {wrong}"
