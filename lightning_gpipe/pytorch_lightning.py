"""``GPipeStrategy`` for the standalone ``pytorch_lightning`` package, built from the same source as the unified one."""

# How: Lightning builds its standalone packages from the unified sources with the imports rewritten; this module does
# the same at import time. A meta-path finder loads every module of ``lightning_gpipe.strategy`` a second time, as
# ``lightning_gpipe.pytorch_lightning.strategy...``, from the same files with ``lightning.pytorch`` read as
# ``pytorch_lightning``, ``lightning.fabric`` as ``lightning_fabric`` and ``lightning_gpipe.strategy`` as the mirror.
# The engine, ``lightning_gpipe.pipe``, imports no Lightning and is not mirrored: both strategies drive the same one.
# The mirror lives under this module (made a package by ``__path__``), so any process that unpickles one of its
# objects imports this module first, which installs the finder.

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import lightning_fabric  # noqa: F401  (the mirrored modules import it; fail here, with the fix, if absent)
    import pytorch_lightning
except ImportError as error:
    raise ImportError(
        "lightning_gpipe.pytorch_lightning needs the standalone PyTorch Lightning package: pip install "
        "pytorch-lightning (or use lightning.pytorch.Trainer with `from lightning_gpipe import GPipeStrategy`)"
    ) from error

__all__ = ["GPipeStrategy"]

_UNIFIED = "lightning_gpipe.strategy"
_MIRROR = f"{__name__}.strategy"
_SOURCES = Path(__file__).resolve().parent / "strategy"

# Each within a line, so the mirrored code keeps the source's line numbers (tracebacks show the real lines).
_REWRITES = (
    (re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"),
    (re.compile(rf"\b{re.escape(_UNIFIED)}\b"), _MIRROR),
)
# What the rewrite cannot map: ``import lightning`` or ``from lightning import ...`` (``\b`` excludes lightning_*).
_UNMAPPED = re.compile(r"^[ \t]*(?:from|import)[ \t]+lightning\b(?!\.(?:pytorch|fabric)\b)", re.MULTILINE)


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def _check_version() -> None:
    """The strategy is written against the Lightning it requires: the standalone package must be the same minor."""
    try:
        unified = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        return
    if _minor(pytorch_lightning.__version__) != _minor(unified):
        want = ".".join(_minor(unified))
        raise ImportError(
            f"lightning_gpipe.pytorch_lightning supports the Lightning version it requires ({want}.x, as the "
            f"installed lightning {unified}); pytorch_lightning is {pytorch_lightning.__version__}: "
            f"pip install 'pytorch-lightning=={want}.*'"
        )


def rewrite(source: str, path: str = "<string>") -> str:
    """``source`` (a module of ``lightning_gpipe.strategy``) as its ``pytorch_lightning`` mirror reads it."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    unmapped = _UNMAPPED.search(source)
    if unmapped is not None:
        number = source.count("\n", 0, unmapped.start()) + 1
        line = source.splitlines()[number - 1].strip()
        raise ImportError(
            f"{path}:{number}: {line!r} names neither lightning.pytorch nor lightning.fabric, so "
            "lightning_gpipe.pytorch_lightning cannot map it to the standalone packages"
        )
    return source


class _RewritingLoader(importlib.abc.SourceLoader):
    """Loads one mirrored module from its unified source file, rewritten.

    No ``path_stats``: ``SourceLoader`` then neither reads nor writes bytecode, which would be the unified module's
    own ``.pyc`` (the same source path), compiled without the rewrite.
    """

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def get_filename(self, fullname: str) -> str:
        return self.path  # __file__: tracebacks, inspect and linecache read the real file

    def get_data(self, path: str) -> bytes:
        # The source as the mirror reads it; get_code compiles it and get_source returns it.
        with open(path, "rb") as f:
            source = importlib.util.decode_source(f.read())
        return rewrite(source, path).encode()


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_gpipe.pytorch_lightning.strategy[.name...]`` in ``lightning_gpipe/strategy``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MIRROR and not fullname.startswith(_MIRROR + "."):
            return None
        where = _SOURCES.joinpath(*fullname[len(_MIRROR) :].split(".")[1:])
        if (where / "__init__.py").is_file():
            file, package = where / "__init__.py", True
        elif where.with_suffix(".py").is_file():
            file, package = where.with_suffix(".py"), False
        else:
            return None
        # The loader's get_filename makes this a located spec: the module's __file__ is the source file.
        spec = importlib.util.spec_from_loader(fullname, _RewritingLoader(file), is_package=package)
        if spec is not None and package:
            # Not the source directory, which the spec adds: the path finder would load the submodules unrewritten.
            spec.submodule_search_locations = []
        return spec


def _install() -> None:
    # Once per process, also if this module is executed again (importlib.reload, a test deleting it).
    if not any(type(f).__name__ == _MirrorFinder.__name__ and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _MirrorFinder())  # before the path finder; it answers for the mirror's names only


_check_version()
# A package with no directory of its own: its submodules come from the finder alone.
__path__: list[str] = []
_install()

#: ``lightning_gpipe.GPipeStrategy`` built on ``pytorch_lightning``: a ``pytorch_lightning.strategies.ParallelStrategy``
#: for ``pytorch_lightning.Trainer``, registered there as ``strategy="gpipe"``, with the same arguments.
GPipeStrategy: type[Any] = importlib.import_module(_MIRROR).GPipeStrategy
