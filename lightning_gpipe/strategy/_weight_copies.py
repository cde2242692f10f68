"""Weights with copies on other ranks (replicas, replicated layers, ties): kept equal, owned once, through precision."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.dp.clipping import clip_grad_norm_
from lightning_gpipe.pipe.dp.grads import sum_over_pipeline
from lightning_gpipe.strategy._audit import outside_modules
from lightning_gpipe.strategy._lightning_internals import broadcast_coalesced, route_norm_clipping

_BROADCAST_BUCKET = 250 * 2**20  # DDP's default for its initial broadcast


class WeightCopies:
    """Where each parameter of one rank has copies, and the collectives that keep the copies equal.

    Three kinds, on the (dp × K) mesh (``stage_ranks[k]``: stage k's global ranks, replica 0 first):

    - every tensor of the module has copies on the other data-parallel replicas (the dp group);
    - parameters outside the backbone (an embedding before it, a head after it) have a copy on every stage, and so
      does a weight that a module outside shares with a backbone layer (an input embedding tied to the backbone's
      output projection): its gradient is the sum over every stage, as for any replicated parameter;
    - a weight tied between layers of different stages (an input embedding and output projection) has a copy on
      each stage that uses it: one process group per such set of stages, per replica (and its gloo twin, for the
      vote on which gradients to sum, where the world's backend is not gloo).

    The sums' votes run over gloo groups (``header_group``, the same ranks as ``pp_group``; default ``pp_group``),
    so that the host never waits for the GPU to read them (see ``pipe.dp.grads.used_somewhere``). Built collectively
    (``new_group`` must be called by every rank in the same order).
    """

    def __init__(
        self,
        module: nn.Module,
        stage: GPipeStage,
        stage_ranks: Sequence[Sequence[int]],
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
        # A tie group has the world's backend: where that is not gloo, a twin over the same ranks takes the votes.
        twins = bool(sets) and dist.is_initialized() and dist.get_backend() != "gloo"
        for stages in sets:
            # A tied weight also used outside the backbone is summed over every stage already.
            params = [p for _, s, p in stage.shared if s == stages and p is not None and id(p) not in replicated]
            for d in range(len(stage_ranks[0])):
                ranks = [stage_ranks[s][d] for s in stages]
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
        # A shard over the replicas (FSDP's, from a meta-device build) was materialized alike on every replica, each
        # its part; a tensor-parallel part is the same part on each replica, broadcast as a whole tensor is.
        held = (*self.module.parameters(), *self.module.buffers())
        tensors = [local(t.detach()) for t in held if not split_over_replicas(t)]
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


# Which rank owns each parameter and buffer: the value every holder of it keeps, and every checkpoint saves.
#
# The rule. A tensor is owned by the stage that runs it: a backbone layer's tensors by that layer's stage, under every
# name that holds the layer (``model.layer1`` as well as ``backbone.4``); any other tensor (a module outside the
# backbone) by the last stage, the one that sees the backbone's true output (with the loss inside the pipeline the
# head runs there only). Of the data-parallel replicas, replica 0 owns (as a DDP run's rank 0 writes its checkpoint).
# Each key of a saved checkpoint takes its owner's value. Parameters are equal on every holder anyway (gradients
# summed over the stages that hold them); buffers are not, so the buffers of backbone layers that a module outside
# the backbone holds too are copied from their stage to the other stages after every training step.


_BUCKET = 25 * 2**20


def run_keys(model: nn.Module, stage: nn.Module) -> set[str]:
    """The keys of ``model.state_dict()`` whose tensor this rank's stage runs (an alias's names included)."""
    ids = {id(t) for t in chain(stage.parameters(), stage.buffers())}
    return {k for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor) and id(v) in ids}


class Owners:
    """Every key's owning stage, from each rank's (keys held, keys its stage runs); ``stage_ranks[k]``: stage k's
    global ranks, replica 0 first.

    A key the stages run is owned by the first stage that runs it; any other by the last stage; a key the last stage
    lacks (a layer's extra state) by the first stage that holds it; of that stage's replicas, replica 0 saves it.
    Collective: every rank builds it.
    """

    def __init__(
        self, model: nn.Module, stage: nn.Module, stage_ranks: Sequence[Sequence[int]], keys: set[str]
    ) -> None:
        K = len(stage_ranks)
        self.stage_ranks, self.rank = stage_ranks, dist.get_rank() if dist.is_initialized() else 0
        mine = (sorted(keys), sorted(run_keys(model, stage) & keys))
        parts: list[Any] = [mine]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        first = [parts[ranks[0]] for ranks in stage_ranks]  # replica 0's stages
        held, run = [set(p[0]) for p in first], [p[1] for p in first]
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
        """The entries of this rank's ``state`` (a model state dict) that this rank saves: its owner's, and a sharded
        tensor's (FSDP's DTensor) on every replica of its owner, each with its shard."""
        ranks = self.stage_ranks
        return {
            k: v
            for k, v in state.items()
            if k in self.owner
            and (ranks[self.owner[k]][0] == self.rank or (isinstance(v, DTensor) and self.rank in ranks[self.owner[k]]))
        }


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


# The precision plugin under a pipeline: ties kept through its conversion, one loss-scaling decision for every
# stage, clipping by the whole norm.


@contextmanager
def keeping_ties(module: nn.Module | None) -> Iterator[None]:
    """A tensor that several of ``module``'s submodules hold (a tied weight; a layer's buffers also held by its
    DeferredBatchNorm stand-in, or by another module object) is again one tensor, held by all of them, after the body
    converts the module (``precision_plugin.convert_module``, ``.to(device)``).

    ``Module._apply`` gives each module its own converted buffer (and, with
    ``torch.__future__.set_overwrite_module_params_on_conversion``, its own parameter): two holders of one tensor would
    then train apart, the first one's running statistics moving while the other's stay behind.
    """
    holders: dict[int, list[tuple[dict, str]]] = {}
    for m in module.modules() if module is not None else ():
        for slots in (m._parameters, m._buffers):
            for key, t in slots.items():
                if t is not None:
                    holders.setdefault(id(t), []).append((slots, key))
    shared = [h for h in holders.values() if len(h) > 1]
    yield
    for (first, key), *rest in shared:
        for slots, other in rest:
            slots[other] = first[key]


def agree_on_loss_scaling(plugin: Precision, device: torch.device) -> None:
    """16-mixed: a stage that finds an inf must make every stage skip the step, not only itself."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return
    # ShardedGradScaler all-reduces found_inf over the world group (pipeline stages and replicas alike).
    sharded = _PipelineGradScaler(
        device=device.type,
        init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
        backoff_factor=scaler.get_backoff_factor(),
        growth_factor=scaler.get_growth_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )
    # Any plugin that keeps a GradScaler there (MixedPrecision, or a user's own), as the getattr above reads it.
    setattr(plugin, "scaler", sharded)  # noqa: B010


def split_over_replicas(t: torch.Tensor) -> bool:
    """Whether ``t`` is split over the data-parallel replicas (FSDP's shard), not only over tensor-parallel ranks."""
    return isinstance(t, DTensor) and "data_parallel" in (t.device_mesh.mesh_dim_names or ())


class _PipelineGradScaler(ShardedGradScaler):
    """torch's ShardedGradScaler, unscaling a sharded gradient (data_parallel="fsdp": a DTensor beside whole ones,
    which torch's kernel cannot take together) through its local shard, a view of it."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        groups = [
            {"params": [SimpleNamespace(grad=None if p.grad is None else local(p.grad)) for p in group["params"]]}
            for group in optimizer.param_groups
        ]
        return super()._unscale_grads_(SimpleNamespace(param_groups=groups), inv_scale, found_inf, allow_fp16)  # type: ignore[arg-type]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local tensor, a view of it), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def fit_to_pipeline(plugin: Precision, copies: WeightCopies, pp_group: dist.ProcessGroup, device: torch.device) -> None:
    """What ``plugin`` needs to see the pipeline as one model: its loss scaling and its norm clipping."""
    # Lightning clips with a local norm; a pipeline needs the norm of the whole model across stages.
    route_norm_clipping(plugin, pipeline_norm_clipping(plugin, copies, pp_group))
    agree_on_loss_scaling(plugin, device)


def pipeline_norm_clipping(
    plugin: Precision, copies: WeightCopies, pp_group: dist.ProcessGroup
) -> Callable[[torch.optim.Optimizer, int | float], None]:
    """Clipping by the norm of the whole model's gradient: every stage's share, each weight with copies once."""

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        counted, copied = copies.split_for_norm(list(plugin.main_params(optimizer)))
        clip_grad_norm_(counted, copied, clip_val, 2.0, pp_group, count_replicated=False)

    return clip_grad_by_norm
