"""The package's shape: no import circle, the engine's parts as folders that import only down, and GPipeStrategy one
Lightning strategy class over a few private helpers."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lightning.pytorch.strategies import ParallelStrategy, Strategy

from lightning_gpipe.strategy import GPipeStrategy
from tests.helpers import ROOT

PACKAGE = ROOT / "lightning_gpipe"
STRATEGY = PACKAGE / "strategy"


def module_imports(path: Path) -> set[str]:
    """The package's modules a file imports when it is imported: its top-level statements, not function bodies."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:` and `try: import x` run at import too
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_gpipe")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_gpipe"):
            for alias in node.names:  # ``from lightning_gpipe.strategy import _mesh`` imports that module
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / f"{sub.replace('.', '/')}.py").exists()
                found.add(sub if is_module else str(node.module))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest module
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_no_import_circle_in_the_package() -> None:
    graph = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): module_imports(p)
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    # A package imports its own __init__ first: an edge from a submodule to its package is no circle.
    graph = {m: {d for d in deps if not m.startswith(f"{d}.")} for m, deps in graph.items()}
    assert circles(graph) == []


def engine_imports() -> dict[str, set[str]]:
    """Each engine module (``pipe.run.executor``) and the engine modules it imports at import time."""
    return {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): {
            m.removeprefix("lightning_gpipe.") for m in module_imports(p)
        }
        for p in sorted((PACKAGE / "pipe").rglob("*.py"))
    }


# The engine's parts, bottom up: a part imports only from its own folder and the parts before it (pipe.__init__
# re-exports the public names and may import anything).
LAYERS = [
    {"pipe.errors", "pipe._torch_internals", "pipe.microbatch", "pipe.skips", "pipe.context"},
    {"pipe.state", "pipe.schedule", "pipe.trace", "pipe.dp"},
    {"pipe.split", "pipe.comm"},
    {"pipe.run"},
    {"pipe.stage"},
]


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == part or module.startswith(f"{part}.") for part in layer):
            return i
    raise AssertionError(f"{module} belongs to no part of the engine: add it to LAYERS")


def test_the_engine_is_a_few_folders_each_importing_only_down() -> None:
    top = sorted(p.name for p in (PACKAGE / "pipe").glob("*.py"))
    assert len(top) <= 12, top
    folders = sorted(p.name for p in (PACKAGE / "pipe").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["comm", "dp", "run", "schedule", "split", "state", "trace"]
    for path in (PACKAGE / "pipe").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, path  # a first line that says what the module is for
    upward = [
        f"{module} imports {dep}"
        for module, deps in engine_imports().items()
        if module != "pipe"
        for dep in deps
        if dep.startswith("pipe.") and layer_of(dep) > layer_of(module)
    ]
    assert upward == []
    assert all(not dep.startswith("strategy") for deps in engine_imports().values() for dep in deps)


def test_strategy_is_one_class_over_private_helpers() -> None:
    modules = sorted(STRATEGY.glob("*.py"))
    assert len(modules) <= 21, [p.name for p in modules]
    for path in modules:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), path.name  # its first line says what the module is for
        assert path.name in ("__init__.py", "gpipe.py") or path.name.startswith("_"), path.name
    assert len((STRATEGY / "gpipe.py").read_text().splitlines()) <= 550
    # No mixins: every Lightning hook GPipeStrategy implements is its own method, marked as an override.
    assert GPipeStrategy.__bases__ == (ParallelStrategy,)
    lightning = {name for cls in (Strategy, ParallelStrategy) for name in vars(cls)}
    for name, member in vars(GPipeStrategy).items():
        if name.startswith("__") or name not in lightning or not (callable(member) or isinstance(member, property)):
            continue
        function = member.fget if isinstance(member, property) else member
        assert getattr(inspect.unwrap(function), "__override__", False), f"GPipeStrategy.{name} lacks @override"
