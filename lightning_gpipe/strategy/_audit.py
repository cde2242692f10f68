"""The setup audit: every reference to the backbone, every weight it shares, each finding handled and logged."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.strategy._split_dim import check_split_dim

# Under Lightning's logger, so the findings print where its own setup messages do (it sets INFO and a handler).
logger = logging.getLogger("lightning.pytorch.strategies.gpipe")


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def backbone_references(root: nn.Module, backbone: nn.Module) -> list[tuple[str, Any, str | int]]:
    """Every place in ``root`` that holds ``backbone``: (path, container, key).

    A container is a module's submodule table (``self.backbone``, ``self.vit.blocks``), its ``__dict__`` (a plain
    attribute), or a list or dict held by a plain attribute (``self.parts = [self.vit.blocks]``). All of them must
    see the pipeline stage, or a rank keeps (and saves, and trains) the whole backbone under the other name.
    """
    found: list[tuple[str, Any, str | int]] = []
    for name, module in root.named_modules():
        for key, child in module._modules.items():
            if child is backbone:
                found.append((_join(name, key), module._modules, key))
        for key, value in vars(module).items():
            if key.startswith("__") or key in ("_modules", "_parameters", "_buffers"):
                continue
            if value is backbone:
                found.append((_join(name, key), vars(module), key))
            elif isinstance(value, list):
                found += [(f"{_join(name, key)}[{i}]", value, i) for i, v in enumerate(value) if v is backbone]
            elif isinstance(value, dict):
                found += [(f"{_join(name, key)}[{k!r}]", value, k) for k, v in value.items() if v is backbone]
            elif isinstance(value, tuple) and any(v is backbone for v in value):
                raise TypeError(
                    f"GPipeStrategy: {_join(name, key)} is a tuple holding the backbone; a tuple cannot be pointed at "
                    "the pipeline stage, so this rank would keep the whole backbone. Hold it in a list or as a "
                    "submodule attribute, or drop the reference"
                )
    return found


def point_at_stage(references: list[tuple[str, Any, str | int]], stage: nn.Module) -> None:
    for _, container, key in references:
        container[key] = stage


class StagePart(nn.Module):
    """Base of the modules that hold this rank's part of a copy of the backbone (an average of its weights): like
    the stage, each rank holds another part, so none of them is among the modules kept on every stage."""


def outside_modules(root: nn.Module, backbone: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules reachable from ``root`` without entering ``backbone`` (or a :class:`StagePart`), with the first path
    that reaches them."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, m = stack.pop()
        if m is backbone or isinstance(m, StagePart) or id(m) in seen:
            continue
        seen.add(id(m))
        yield name, m
        children = [(_join(name, k), c) for k, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))


def shared_with_outside(root: nn.Module, backbone: nn.Sequential, path: str) -> list[str]:
    """Findings: backbone layers held, or weights shared, by modules outside the backbone (before it is split)."""
    held: dict[int, str] = {}
    outside_params: dict[int, str] = {}
    for name, m in outside_modules(root, backbone):
        held.setdefault(id(m), name)
        for key, p in m._parameters.items():
            if p is not None:
                outside_params.setdefault(id(p), _join(name, key))
    findings = []
    for i, (layer_name, layer) in enumerate(backbone._modules.items()):
        assert layer is not None
        if id(layer) in held:
            findings.append(
                f"layer {i} ({type(layer).__name__}) of self.{path} is also self.{held[id(layer)]}: it is "
                "kept on every stage, its parameters' gradients summed over the stages"
            )
            continue
        for key, p in layer.named_parameters():
            if id(p) in outside_params:
                findings.append(
                    f"self.{path}.{layer_name}.{key} is tied to self.{outside_params[id(p)]} outside the backbone: "
                    "kept on every stage, its gradient summed over the stages"
                )
    return findings


class BackboneAudit:
    """What setup must know before the backbone (at ``path`` in ``root``) is split, and the hand-over to the stage.

    Taken on the whole backbone: its references (aliases) and the weights it shares with modules outside it. After
    the split, :meth:`hand_over` points every reference at the stage (none may keep, save or train the whole
    backbone) and logs one line per finding, ties across stages included.
    """

    def __init__(self, root: nn.Module, backbone: nn.Sequential, path: str) -> None:
        self.path = path
        self.references = backbone_references(root, backbone)
        self.findings = [
            f"self.{where} is self.{path}: both now hold this rank's pipeline stage"
            for where, _, _ in self.references
            if where != path
        ]
        self.findings += shared_with_outside(root, backbone, path)

    def hand_over(self, stage: Any, *, log: bool) -> None:
        point_at_stage(self.references, stage)
        self.findings += [
            f"self.{self.path}.{name} is tied across stages {list(stages)}: its gradient summed over them"
            for name, stages, _ in stage.shared
        ]
        if log:  # the findings are the same on every rank
            for finding in self.findings:
                logger.info(f"GPipeStrategy: {finding}")


class StepAudit:
    """What only a running training step shows. At every call of the backbone with grad: a call while the previous
    one awaits its backward is refused in the user's terms (every rank, at the call). At its first call in a fit:
    an input split along a dimension that is not the loader's samples stops every rank; a split size the batch does
    not have is warned about by global rank 0. Buffers the backbone's layers change in forward: warned per stage, by
    its first replica, as soon as seen."""

    def __init__(self, stage: Any, path: str, batch_dim: int, dp_group: Any, rank: int) -> None:
        self.path, self.batch_dim, self.rank = path, batch_dim, rank
        self.first_replica = dp_group is None or dist.get_rank(dp_group) == 0
        self.stateful_reported = False
        self.batch: Any = None
        self.checked = False
        self._stage = stage
        stage.register_forward_pre_hook(self._see_input)

    def start_step(self, batch: Any) -> None:
        """Before the user's training step: the loader's batch the backbone's input is compared with."""
        self.batch = batch

    def _see_input(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or self.batch is None:
            return  # evaluation, or a call outside a training step
        if self._stage.pending:
            raise RuntimeError(
                f"GPipeStrategy: self.{self.path} was called again, with grad, before the loss of its previous call "
                "was back-propagated. Each call runs one forward pass through every stage, and its backward must "
                "run before the next: call the backbone once per training step (with manual optimization, once "
                "per self.manual_backward). Calls under torch.no_grad() are free. To run it on several inputs "
                "(a GAN's discriminator on real and fake samples), call it once on torch.cat([real, fake]) and "
                "split its output"
            )
        if self.checked or not args:
            return
        self.checked = True
        warning = check_split_dim(args[0], self.batch, self.batch_dim, self.path)
        if warning is not None and self.rank == 0:
            warnings.warn(warning, stacklevel=2)

    def __call__(self, stage: Any, batch: Any) -> None:
        self.batch = None
        if not self.stateful_reported and stage.buffers_changed_in_forward:
            self.stateful_reported = True
            if self.first_replica:
                _warn_stateful(stage, self.path)


def _warn_stateful(stage: Any, path: str) -> None:
    """That cannot match one device for every kind of state, and the user must know which kind theirs is."""
    names = [f"{path}.{name}" for name in stage.buffers_changed_in_forward]
    warnings.warn(
        f"GPipeStrategy: on stage {stage.index}, the backbone's layers change these buffers in forward: "
        f"{names}. Under GPipe a layer runs once per micro-batch (M = {stage.chunks} "
        "times per step, on about N/M samples each), not once per batch: a running count or sum ends as on one "
        "device, an average or EMA over batches does not. Re-materialization never repeats the change (the "
        "recompute restores them). Keep per-batch state outside the backbone, or update it per micro-batch "
        "knowingly (lightning_gpipe.pipe.is_recomputing() tells a layer it is being recomputed)",
        stacklevel=3,
    )
