"""Indexing a stage like the nn.Sequential it replaced: by global layer index, on every stage alike."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Mapping, Sequence
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
        raise RuntimeError(
            f"{self.where}; it can only run there, inside the pipeline. Call the pipelined module whole "
            "(self.backbone(x) in a LightningModule), which runs every layer on its stage: iterating over its layers "
            "(for layer in self.backbone: x = layer(x)) or calling one of them runs only what this rank holds"
        )

    def extra_repr(self) -> str:
        return self.where


class LayerIndex:
    """The layers of the whole backbone by global index, as seen from stage ``index`` of the split ``balance``.

    ``len`` is L, all layers of the backbone; :meth:`get` of i is layer i (global, negative too) when this stage
    holds it and a :class:`RemoteLayer` otherwise; of a slice, an nn.Sequential of the layers of that range this stage
    holds, under their global names. ``held`` is the stage's own layers by name. Placeholders are made on demand and
    never registered, so state dicts and named_modules only ever see this stage's own layers.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: list[int],
        index: int,
        stages: Sequence[int] = (),
        homes: Sequence[int] = (),
    ) -> None:
        self._names = list(module._modules)
        self._kinds = [type(layer).__name__ for layer in module]
        self._balance = balance
        self._index = index
        # The stages this rank holds: ``index`` alone, or its virtual stages (interleaving: a count each in balance).
        self._stages = list(stages) or [index]
        self._homes = list(homes) or list(range(len(balance)))  # the rank of each stage
        self._remote: dict[int, RemoteLayer] = {}

    def __len__(self) -> int:
        return len(self._names)

    def label(self, i: int) -> str:
        """How errors name layer i: its name in the whole backbone and its class, e.g. ``layer 3 (GRU)``."""
        return f"layer {self._names[i]} ({self._kinds[i]})"

    def get(self, index: int | slice, held: Mapping[str, nn.Module | None]) -> nn.Module:
        if isinstance(index, slice):
            names = [self._names[i] for i in range(*index.indices(len(self)))]
            return nn.Sequential(OrderedDict((name, layer) for name in names if (layer := held.get(name)) is not None))
        i = operator.index(index)
        L = len(self)
        if not -L <= i < L:
            raise IndexError(f"layer index {i} is out of range: the pipelined backbone has {L} layers")
        i %= L
        layer = held.get(self._names[i])
        if layer is not None:
            return layer
        if i not in self._remote:
            self._remote[i] = RemoteLayer(self._where(i))
        return self._remote[i]

    @property
    def layer_ranges(self) -> list[range]:
        """The global indices of the layers of each stage this rank holds (one, or one per chunk)."""
        return [range(sum(self._balance[:s]), sum(self._balance[: s + 1])) for s in self._stages]

    @property
    def layer_range(self) -> range:
        """The global indices of the layers this stage holds."""
        ranges = self.layer_ranges
        if len(ranges) > 1:
            raise RuntimeError(
                f"this rank holds {len(ranges)} virtual stages, not one range of layers: use layer_ranges"
            )
        return ranges[0]

    def _where(self, i: int) -> str:
        owner = next(k for k in range(len(self._balance)) if i < sum(self._balance[: k + 1]))
        held = ", ".join(f"layer {r[0]}" if len(r) == 1 else f"layers {r[0]}–{r[-1]}" for r in self.layer_ranges)
        if len(self._stages) == 1:
            return f"{self.label(i)} is on stage {owner}; this rank is stage {self._index} and holds {held}"
        rank = self._homes[owner]
        return f"{self.label(i)} is on rank {rank} (stage {owner}); this rank is {self._index} and holds {held}"
