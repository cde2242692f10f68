"""Weight averages of a pipelined backbone (EMA, SWA): each rank's averaged copy holds and averages its own stage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_gpipe.strategy._audit import StagePart, backbone_references, point_at_stage

# timm's EMA wrappers (timm.utils.model_ema), known by class name: timm is not a dependency.
_TIMM_EMA = ("ModelEma", "ModelEmaV2", "ModelEmaV3")
Structure = tuple[tuple[str, tuple[int, ...]], ...]


def structure(module: nn.Module) -> Structure:
    """The state-dict keys and shapes: what a copy made with ``copy.deepcopy`` shares with its original."""
    state = module.state_dict(keep_vars=True)
    return tuple((k, tuple(v.shape)) for k, v in state.items() if isinstance(v, torch.Tensor))


def averaging_wrappers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """torch's ``AveragedModel`` and timm's ``ModelEma*`` in ``root``, by name; each holds its copy in ``.module``."""
    return [
        (name, m)
        for name, m in root.named_modules()
        if (isinstance(m, AveragedModel) or type(m).__name__ in _TIMM_EMA)
        and isinstance(getattr(m, "module", None), nn.Module)
    ]


class StageCopy(StagePart):
    """This rank's part of a copy of the backbone: the copy's layers of this rank's stage, under their names in the
    backbone (``ema.module.6.weight`` as in the plain module), in the stage's order, so that averaging code, which
    pairs the copy's tensors with the model's in order, pairs each layer with itself.

    Called (``self.ema(x)`` to evaluate the average), it runs the pipeline with its values swapped into the stage:
    every stage must call it, as the backbone, without grad.
    """

    def __init__(self, whole: nn.Module, names: list[str], stage: nn.Module) -> None:
        super().__init__()
        for name in names:
            layer = whole._modules[name]
            assert layer is not None, f"layer {name} of the backbone's copy is None"
            self.add_module(name, layer)
        self._stage = [stage]  # in a list: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "GPipeStrategy: an averaged copy of the pipelined backbone runs through the pipeline with its values "
                "swapped into the stage, which cannot be back-propagated: call it under torch.no_grad() (validation "
                "and test steps run so)"
            )
        stage = self._stage[0]
        pairs = list(zip([*self.parameters(), *self.buffers()], [*stage.parameters(), *stage.buffers()]))
        modes = [(m, m.training) for m in stage.modules()]
        for m, mine in zip(stage.modules(), self.modules()):
            m.training = mine.training
        _swap(pairs)
        try:
            return stage(*args, **kwargs)
        finally:
            _swap(pairs)
            for m, mode in modes:
                m.training = mode


def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for a, b in pairs:
        a.data, b.data = b.data, a.data


class WeightAverages:
    """The averaged copies of the backbone, or of a module holding it, that must follow the split (taken before it).

    Found: torch's ``AveragedModel`` and timm's ``ModelEma*`` anywhere in ``root``, and the copies that Lightning's
    ``WeightAveraging`` and ``StochasticWeightAveraging`` callbacks hold (``callbacks``: (holder, attribute) pairs).
    Such a copy is made with ``deepcopy`` before the strategy sees the model, so it is recognised by its structure:
    the state-dict keys and shapes of the backbone or of a module holding it. :meth:`follow` replaces the backbone in
    each copy with a :class:`StageCopy` of this rank's layers; the copy then pairs with the pipelined module tensor
    for tensor. A copy that holds the backbone's structure inside a module of another structure cannot be paired so:
    refused, on every rank alike.
    """

    def __init__(
        self,
        root: nn.Module,
        backbone: nn.Module,
        path: str,
        references: list[tuple[str, Any, str | int]],
        callbacks: list[tuple[Any, str]],
    ) -> None:
        holders: dict[Structure, str] = {}  # a module holding the backbone → the backbone's path inside it
        for where, _, _ in references:
            if "[" in where:
                continue  # held in a list or dict: not a module path
            parts = where.split(".")
            for i in range(len(parts) + 1):
                holder = root.get_submodule(".".join(parts[:i]))
                holders.setdefault(structure(holder), ".".join(parts[i:]))
        places: list[tuple[Any, str, str]] = [(w, "module", f"self.{name}") for name, w in averaging_wrappers(root)]
        for holder, attribute in callbacks:
            copy = getattr(holder, attribute)
            places.append((holder, attribute, f"the {type(holder).__name__}'s copy of the LightningModule"))
            places += [(w, "module", f"{name} in that copy") for name, w in averaging_wrappers(copy)]
        whole = structure(backbone)
        self.copies: list[tuple[Any, str, str]] = []  # (holder, attribute, the backbone's path in the copy)
        self.findings: list[str] = []
        for holder, attribute, where in places:
            copy = getattr(holder, attribute)
            inside = holders.get(structure(copy))
            if inside is not None:
                self.copies.append((holder, attribute, inside))
                self.findings.append(f"{where} averages self.{path}: each rank's copy holds and averages its stage")
            elif any(structure(m) == whole for m in copy.modules()):
                raise TypeError(
                    f"GPipeStrategy: {where} averages a module that holds a copy of self.{path} but is neither it "
                    "nor a module holding it, so its layers cannot be paired with each rank's stage. Average "
                    f"self.{path} itself (AveragedModel(self.{path}), timm's ModelEmaV3(self.{path})), or the "
                    "whole LightningModule (Lightning's WeightAveraging callback)"
                )

    def follow(self, stage: nn.Module) -> None:
        """Each copy keeps only this rank's layers (memory ∝ the stage), in the stage's order."""
        names = [name for name, _ in stage.named_children()]
        for holder, attribute, inside in self.copies:
            copy = getattr(holder, attribute)
            whole = copy.get_submodule(inside)
            part = StageCopy(whole, names, stage)
            if inside:
                point_at_stage(backbone_references(copy, whole), part)
            else:
                setattr(holder, attribute, part)
