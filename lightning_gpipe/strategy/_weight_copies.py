"""Parameters with copies on other ranks (replicas, replicated head/embedding, tied weights) and keeping them equal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.grads import sum_over_pipeline
from lightning_gpipe.strategy._audit import outside_modules
from lightning_gpipe.strategy._lightning_internals import broadcast_coalesced

_BROADCAST_BUCKET = 250 * 2**20  # DDP's default for its initial broadcast


class WeightCopies:
    """Where each parameter of one rank has copies, and the collectives that keep the copies equal.

    Three kinds, on the (dp × K) mesh where rank = d·K + k:

    - every tensor of the module has copies on the other data-parallel replicas (the dp group);
    - parameters outside the backbone (an embedding before it, a head after it) have a copy on every stage, and so
      does a weight that a module outside shares with a backbone layer (an input embedding tied to the backbone's
      output projection): its gradient is the sum over every stage, as for any replicated parameter;
    - a weight tied between layers of different stages (an input embedding and output projection) has a copy on
      each stage that uses it: one process group per such set of stages, per replica (and its gloo twin, for the
      vote on which gradients to sum, where the world's backend is not gloo).

    The sums' votes run over gloo groups (``header_group``, the same ranks as ``pp_group``; default ``pp_group``),
    so that the host never waits for the GPU to read them (see ``pipe.grads.used_somewhere``). Built collectively
    (``new_group`` must be called by every rank in the same order).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: GPipeStage,
        K: int,
        rank: int,
        pp_group: Any,
        dp_group: Any,
        header_group: Any = None,
    ) -> None:
        self.module, self.stage = module, stage
        self.pp_group, self.dp_group = pp_group, dp_group
        self.header_group = header_group if header_group is not None else pp_group
        self.replicated = outside_parameters(module, stage)
        replicated = {id(p) for p in self.replicated}
        self.tied: list[tuple[Any, list[nn.Parameter]]] = []
        self._tie_votes: list[Any] = []  # per entry of ``tied``: the gloo group over its ranks
        self._not_first_holder: set[int] = set()
        sets = list(dict.fromkeys(stages for _, stages, _ in stage.shared))
        world = dist.get_world_size() if dist.is_initialized() else 1
        # A tie group has the world's backend: where that is not gloo, a twin over the same ranks takes the votes.
        twins = bool(sets) and dist.is_initialized() and dist.get_backend() != "gloo"
        for stages in sets:
            # A tied weight also used outside the backbone is summed over every stage already.
            params = [p for _, s, p in stage.shared if s == stages and p is not None and id(p) not in replicated]
            for d in range(world // K):
                ranks = [d * K + s for s in stages]
                group = dist.new_group(ranks)
                votes = dist.new_group(ranks, backend="gloo") if twins else group
                if rank in ranks:
                    self.tied.append((group, params))
                    self._tie_votes.append(votes)
            if stage.index in stages and stage.index != stages[0]:
                self._not_first_holder.update(id(p) for p in params)

    def broadcast_initial_state(self) -> None:
        """Replicas start identical (replica 0's values), and so do copies on several stages (stage 0's, or the
        first holder's): as DDP does, so that an unseeded model still trains as one model."""
        tensors = [t.detach() for t in (*self.module.parameters(), *self.module.buffers())]
        _broadcast(tensors, self.dp_group)
        _broadcast([p.detach() for p in self.replicated], self.pp_group)
        for group, params in self.tied:
            _broadcast([p.detach() for p in params], group)

    @property
    def copied(self) -> list[nn.Parameter]:
        """This rank's parameters with a copy on another stage (replicated or tied): their gradients are complete only
        after :meth:`sum_gradients`, a pipeline collective; the others' once this stage's drain ends."""
        return [*self.replicated, *(p for _, params in self.tied for p in params)]

    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum over the stages holding a copy: the gradient of the one weight."""
        sum_over_pipeline(self.replicated, self.pp_group, self.header_group)
        for (group, params), votes in zip(self.tied, self._tie_votes):
            sum_over_pipeline(params, group, votes)

    def split_for_norm(self, params: Sequence[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(counted, not counted) in this stage's share of the global gradient norm: each weight counts once."""
        replicated = {id(p) for p in self.replicated}
        counted: list[nn.Parameter] = []
        skipped: list[nn.Parameter] = []
        for p in params:
            once = not (id(p) in replicated and not self.stage.is_first) and id(p) not in self._not_first_holder
            (counted if once else skipped).append(p)
        return counted, skipped


def outside_parameters(module: nn.Module, stage: nn.Module) -> list[nn.Parameter]:
    """The parameters reachable from ``module`` without passing through ``stage``, in the same order on every rank.

    These are on every stage: the modules outside the backbone, and with them any backbone layer's weight that one
    of those modules shares. Walking the module tree (not ``module.parameters()``, which lists a shared weight at its
    first use, inside the stage on one rank and outside on another) keeps the order the same everywhere.
    """
    params = (p for _, m in outside_modules(module, stage) for p in m._parameters.values() if p is not None)
    return list({id(p): p for p in params}.values())


def _broadcast(tensors: list[torch.Tensor], group: Any) -> None:
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    # Group rank 0 is the source: replica 0, stage 0, or the first stage of a tied set.
    broadcast_coalesced(group, tensors, _BROADCAST_BUCKET, 0)
