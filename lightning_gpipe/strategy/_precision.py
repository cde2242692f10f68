"""The precision plugin under a pipeline: ties kept through its conversion, one loss-scaling decision for every
stage, clipping by the whole norm."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_gpipe.pipe.grads import clip_grad_norm_
from lightning_gpipe.strategy._lightning_internals import route_norm_clipping
from lightning_gpipe.strategy._weight_copies import WeightCopies


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
    sharded = ShardedGradScaler(
        device=device.type,
        init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
        backoff_factor=scaler.get_backoff_factor(),
        growth_factor=scaler.get_growth_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )
    # Any plugin that keeps a GradScaler there (MixedPrecision, or a user's own), as the getattr above reads it.
    setattr(plugin, "scaler", sharded)  # noqa: B010


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
