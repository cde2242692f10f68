"""The backbone's output in an evaluation step with the loss inside: computed where first needed, never shipped idly.

Given straight to ``self.pipeline_loss``, the output stays on the last stage (the loss runs there; only the loss,
logs and metric increments reach the other stages). Used any other way, it becomes the real output first -- the
pipeline runs as it would have -- and every use after that is the real output's: its attributes, operators, torch
functions, and ``isinstance`` (through ``__class__``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_gpipe.pipe._torch_internals import tree_map

_LATE = (
    "GPipeStrategy: the backbone's output was used after this evaluation step ended, but self.pipeline_loss had "
    "taken it, so it exists on the last stage only. Use it inside the step (before or after pipeline_loss), or "
    "return what you computed from it"
)


class LazyOutput:
    """Stands for the backbone's output until something needs it: ``make()`` computes it (on every rank alike)."""

    __slots__ = ("_make", "_ready", "_value", "input", "sealed", "taken")

    def __init__(self, make: Callable[[], Any], input: Any) -> None:
        self._make, self._value, self._ready = make, None, False
        self.input = input  # the backbone's input: what pipeline_loss runs the pipeline with
        self.taken = False  # pipeline_loss ran the pipeline on it, with the loss on the last stage
        self.sealed = False  # its step ended

    @property
    def ready(self) -> bool:
        return self._ready

    def real(self) -> Any:
        """The output itself, computed now if it was not (after ``taken``: by running the pipeline again)."""
        if not self._ready:
            if self.sealed and self.taken:
                raise RuntimeError(_LATE)
            self._value, self._ready = self._make(), True
        return self._value

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(out, torch.Tensor) answers as for the real output
        return type(self.real())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*real_leaves(args), **real_leaves(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real()[key] = value

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return repr(self.real())


def real_leaves(tree: Any) -> Any:
    """``tree`` with every LazyOutput in it replaced by the real output."""
    return tree_map(lambda x: x.real() if isinstance(x, LazyOutput) else x, tree)


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: LazyOutput, *args: Any) -> Any:
        return getattr(self.real(), name)(*real_leaves(args))

    method.__name__ = name
    return method


# Python looks these up on the type, not through __getattr__.
for _name in (
    *(f"__{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")),
    *(f"__r{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")),
    "__lshift__", "__rshift__", "__neg__", "__pos__", "__abs__", "__invert__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__getitem__", "__len__", "__iter__", "__contains__", "__bool__", "__float__", "__int__", "__index__",
    "__format__", "__array__", "__reversed__", "__str__",
):  # fmt: skip
    setattr(LazyOutput, _name, _delegate(_name))
