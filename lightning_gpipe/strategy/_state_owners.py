"""Which rank owns each parameter and buffer: the value every holder of it keeps, and every checkpoint saves.

The rule. A tensor is owned by the stage that runs it: a backbone layer's tensors by that layer's stage, under every
name that holds the layer (``model.layer1`` as well as ``backbone.4``); any other tensor (a module outside the
backbone) by the last stage, the one that sees the backbone's true output (with the loss inside the pipeline the
head runs there only). Of the data-parallel replicas, replica 0 owns (as a DDP run's rank 0 writes its checkpoint).
Each key of a saved checkpoint takes its owner's value. Parameters are equal on every holder anyway (gradients
summed over the stages that hold them); buffers are not, so the buffers of backbone layers that a module outside
the backbone holds too are copied from their stage to the other stages after every training step.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.strategy._audit import outside_modules
from lightning_gpipe.strategy._lightning_internals import broadcast_coalesced

_BUCKET = 25 * 2**20


def run_keys(model: nn.Module, stage: nn.Module) -> set[str]:
    """The keys of ``model.state_dict()`` whose tensor this rank's stage runs (an alias's names included)."""
    ids = {id(t) for t in chain(stage.parameters(), stage.buffers())}
    return {k for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor) and id(v) in ids}


class Owners:
    """Every key's owner, from each rank's (keys held, keys its stage runs); ``K`` stages, rank = d·K + k.

    A key the stages run is owned by the first stage that runs it; any other by the last stage; a key the last stage
    lacks (a layer's extra state) by the first stage that holds it. Collective: every rank builds it.
    """

    def __init__(self, model: nn.Module, stage: nn.Module, K: int, keys: set[str]) -> None:
        self.K = K
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        mine = (sorted(keys), sorted(run_keys(model, stage) & keys))
        parts: list[Any] = [mine]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        held, run = [set(p[0]) for p in parts[:K]], [p[1] for p in parts[:K]]
        self.owner: dict[str, int] = {}
        for k in range(K):
            for key in run[k]:
                self.owner.setdefault(key, k)
        for key in held[K - 1]:
            self.owner.setdefault(key, K - 1)
        for k in range(K):
            for key in held[k]:
                self.owner.setdefault(key, k)

    def owned(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of this rank's ``state`` (a model state dict) that this rank saves."""
        return {k: v for k, v in state.items() if self.owner.get(k) == self.rank}


class HeldBuffers:
    """The buffers of backbone layers that modules outside the backbone hold too (``self.model = resnet18();
    self.backbone = nn.Sequential(*list(self.model.children())[:-1])``): every stage holds them, one stage runs
    them. :meth:`sync` copies each from the stage that runs it to the others. Collective to build (every stage of a
    pipeline walks the same modules outside its stage, in the same order)."""

    def __init__(self, module: nn.Module, stage: nn.Module, pp_group: Any, header_group: Any) -> None:
        self.pp_group = pp_group
        # By holder and name, looked up at each sync: a buffer may be replaced (SWA resets BatchNorm statistics so).
        seen: dict[int, tuple[nn.Module, str]] = {}
        for _, m in outside_modules(module, stage):
            for name, b in m._buffers.items():
                if b is not None:
                    seen.setdefault(id(b), (m, name))
        held = list(seen.values())
        ids = {id(t) for t in stage.buffers()}
        mine = [id(m._buffers[name]) in ids for m, name in held]
        runs: list[Any] = [mine]
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            runs = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(runs, mine, group=header_group)
        by_stage: dict[int, list[tuple[nn.Module, str]]] = {}
        for i, place in enumerate(held):
            src = next((k for k, flags in enumerate(runs) if flags[i]), None)
            if src is not None:  # a buffer outside the backbone only is the same on every stage, or unused
                by_stage.setdefault(src, []).append(place)
        self.by_stage = sorted(by_stage.items())

    def __bool__(self) -> bool:
        return bool(self.by_stage) and self.pp_group is not None and dist.get_world_size(self.pp_group) > 1

    def sync(self) -> None:
        """Every holder of such a buffer takes its stage's value (a collective of the pipeline's stages)."""
        if not self:
            return
        for src, places in self.by_stage:
            tensors = [m._buffers[name] for m, name in places]
            broadcast_coalesced(self.pp_group, [t.detach() for t in tensors if t is not None], _BUCKET, src)
