"""Indexing a stage like the nn.Sequential it replaced: by global layer index, on every stage alike."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from torch import nn


class RemoteLayer(nn.Module):
    """Stands for a layer that another stage holds: no parameters and no buffers, so that code run on every rank
    (param groups from ``backbone[i].parameters()``, ``backbone[i].requires_grad_(False)``) does the right thing
    here; any attribute of the layer itself is a clear error."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __getattr__(self, name: str) -> Any:
        # Called only for what nn.Module does not have: the real layer's attributes (weight, out_features, ...).
        if name.startswith("_"):
            return super().__getattr__(name)
        raise AttributeError(f"{self.where}; its attribute {name!r} is only there (check stage.holds(i) first)")

    def __getitem__(self, index: Any) -> Any:
        # backbone[0][0].weight: the layer is a Sequential on another stage, its sublayers are there too.
        raise TypeError(f"{self.where}; its sublayer [{index!r}] is only there (check stage.holds(i) first)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.where}; it can only run there, inside the pipeline")

    def extra_repr(self) -> str:
        return self.where


class LayerIndexing:
    """Mixed into GPipeStage: ``len(stage)`` is L, all layers of the backbone; ``stage[i]`` is layer i (global,
    negative too) when this stage holds it and a :class:`RemoteLayer` otherwise; ``stage[a:b]`` is an nn.Sequential
    of the layers of that range this stage holds, under their global names; iterating gives ``stage[0]`` to
    ``stage[L - 1]``. Placeholders are made on demand and never registered, so state dicts and named_modules only
    ever see this stage's own layers."""

    _layer_names: list[str]
    _layer_kinds: list[str]
    _balance: list[int]
    _k: int
    _modules: dict[str, nn.Module | None]
    _remote: dict[int, RemoteLayer]

    def _index_layers(self, module: nn.Sequential) -> None:
        self._layer_names = list(module._modules)
        self._layer_kinds = [type(layer).__name__ for layer in module]
        self._remote = {}

    @property
    def _producer(self) -> str:
        """How errors about what crosses the boundary name the layer that returned it: this stage's last."""
        last = self.layer_range[-1]
        return f"layer {self._layer_names[last]} ({self._layer_kinds[last]})"

    def __len__(self) -> int:
        return len(self._layer_names)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int | slice) -> nn.Module:
        if isinstance(index, slice):
            names = [self._layer_names[i] for i in range(*index.indices(len(self)))]
            return nn.Sequential(OrderedDict((name, self._modules[name]) for name in names if name in self._modules))
        i = operator.index(index)
        L = len(self)
        if not -L <= i < L:
            raise IndexError(f"layer index {i} is out of range: the pipelined backbone has {L} layers")
        i %= L
        layer = self._modules.get(self._layer_names[i])
        if layer is not None:
            return layer
        if i not in self._remote:
            self._remote[i] = RemoteLayer(self._where(i))
        return self._remote[i]

    def holds(self, index: int) -> bool:
        """Whether this stage holds layer ``index`` (global, negative too)."""
        return not isinstance(self[index], RemoteLayer)

    @property
    def layer_range(self) -> range:
        """The global indices of the layers this stage holds."""
        start = sum(self._balance[: self._k])
        return range(start, start + self._balance[self._k])

    def _where(self, i: int) -> str:
        owner = next(k for k in range(len(self._balance)) if i < sum(self._balance[: k + 1]))
        mine = self.layer_range
        held = f"layer {mine[0]}" if len(mine) == 1 else f"layers {mine[0]}–{mine[-1]}"
        return (
            f"layer {self._layer_names[i]} ({self._layer_kinds[i]}) is on stage {owner}; "
            f"this rank is stage {self._k} and holds {held}"
        )
