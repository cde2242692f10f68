"""The audits: at setup, the backbone's references and shared weights; in training, its input's split and the loss."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.pipe.microbatch import batch_size, tensors
from lightning_gpipe.strategy._lightning_internals import logger


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


# Is the backbone's input split along the samples? Its first training call compared with the loader's batch.


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _elsewhere(input: Any, batch: Any, split: int, batch_dim: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(dim, input tensor, loader tensor): a loader tensor disagrees with the split size, the backbone's input holds
    that tensor's dim-0 size along another dimension, and a loader tensor holds both sizes: the samples are there,
    not along ``batch_dim``."""
    loaded = [t for t in tensors(batch) if t.dim() > 0]
    # A loader tensor agrees when it holds the split size along dim 0 (batch-first) or batch_dim (as the input).
    # One that does not is either per-sample along dim 0 (labels (N,) beside time-major tokens (T, N)), or a
    # per-batch constant (a vocabulary mask (V,)); the input and the loader both showing the two sizes side by side
    # (time-major tokens (T, N) and hidden states (T, N, D)) separate the two, where a size that merely equals a
    # width (rows of flattened tokens (N·T, D) with D = N) does not.
    disagree = [t for t in loaded if t.shape[0] != split and not (t.dim() > batch_dim and t.shape[batch_dim] == split)]
    for x in tensors(input):
        for j, size in enumerate(x.shape):
            if j == batch_dim:
                continue
            for t in disagree:
                if t.shape[0] == size and any(split in u.shape and size in u.shape for u in loaded):
                    return j, x, t
    return None


def check_split_dim(input: Any, batch: Any, batch_dim: int, path: str) -> str | None:
    """Raise ValueError where splitting ``input`` (the backbone's, at its first training call) along ``batch_dim``
    cuts across another dimension than the loader's ``batch`` has its samples in; return a warning where the split
    size is no size of the batch and nothing tells where its samples went (rows of flattened tokens: maybe meant).
    """
    if not any(t.dim() > 0 for t in tensors(input)):
        return None  # a later stage's input is not used; stage 0's engine names an input without tensors
    try:
        split = batch_size(input, batch_dim)
    except ValueError as e:  # a backbone input of disagreeing tensors: every rank stops here, before the pipeline
        raise ValueError(f"GPipeStrategy: self.{path}'s input cannot be split into micro-batches: {e}") from None
    found = _elsewhere(input, batch, split, batch_dim)
    if found is not None:
        j, x, t = found
        raise ValueError(
            f"GPipeStrategy: self.{path}'s input, of shape {_shape(x)}, is split into micro-batches along dim "
            f"{batch_dim} (batch_dim={batch_dim}), of size {split}, but the loader's batch holds {t.shape[0]} samples "
            f"(a tensor of shape {_shape(t)}), which the input holds along dim {j}: split along dim {batch_dim}, "
            f"each micro-batch would mix every sample and train another model than one device does. Set "
            f"GPipeStrategy(batch_dim={j}) if dim {j} holds the samples in the backbone (time-major (T, N, ...) "
            "layers and data, such as pad_sequence's default), or give the backbone batch-first input "
            "(pad_sequence(..., batch_first=True)). A tensor that is the same for every sample (a mask over the "
            "vocabulary) belongs in the module (a buffer), not in the batch"
        )
    sizes = sorted({t.shape[0] for t in tensors(batch) if t.dim() > 0})
    if not sizes or split in sizes:
        return None
    return (
        f"GPipeStrategy: self.{path}'s input was split into micro-batches along dim {batch_dim}, of size {split}, "
        f"but the loader's batch holds {sizes} samples (dim 0 of its tensors). If the rows along dim {batch_dim} "
        "are independent (tokens flattened into rows), this is the same run; if another dimension holds the samples, "
        "set GPipeStrategy(batch_dim=...) to it, or each micro-batch mixes samples and trains another model."
    )


# The loss may reach the backbone's layers only through the backbone's output: each rank holds only its stage.


def direct_uses(loss: Tensor, stage: nn.Module, replicated: Iterable[nn.Parameter]) -> list[str]:
    """This stage's parameters that ``loss`` uses other than through the backbone's output (an L2 penalty over
    ``self.parameters()``, ``F.linear(h, self.backbone[0].weight)``), by their names in the stage.

    The walk ends at the backbone's output: the stage hands the step a tensor without history on every rank, so
    whatever the graph reaches below the loss was used by the step itself. Weights the stage shares with a module
    outside the backbone (``replicated``) are meant to be used there and are summed over the stages already.
    """
    own = {id(p): name for name, p in stage.named_parameters()}
    for p in replicated:
        own.pop(id(p), None)
    found: list[str] = []
    seen: set[object] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf the graph ends in
        if variable is not None and id(variable) in own:
            found.append(own[id(variable)])
        todo.extend(child for child, _ in node.next_functions)
    return sorted(found)


def check_loss(loss: Tensor, stage: nn.Module, replicated: Iterable[nn.Parameter], path: str, index: int) -> None:
    """Raise, naming the parameters and the fix, if ``loss`` uses this stage's layers directly."""
    used = direct_uses(loss, stage, replicated)
    if used:
        shown = ", ".join(f"{path}.{name}" for name in used[:5]) + (
            f" and {len(used) - 5} more" if len(used) > 5 else ""
        )
        raise RuntimeError(
            f"GPipeStrategy: the training step's loss uses parameters of self.{path} directly ({shown} on stage "
            f"{index}), not only through the backbone's output, e.g. a penalty over self.parameters(). Each rank "
            "holds only its stage's layers, so such a term would cover one stage and differ from the plain run. "
            "Use the optimizer's weight_decay instead, or leave the backbone's parameters out of the term."
        )
