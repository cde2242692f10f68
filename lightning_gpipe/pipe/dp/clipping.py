"""The whole model's gradient norm across the pipeline, and clipping to it (``torch.nn.utils.clip_grad_norm_``'s)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_gpipe.pipe.dp.grads import collective_device, group_size, trainable

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def _norm_device(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> torch.device:
    # A stage without parameters still joins the all-reduce, on a device the backend accepts.
    return params[0].device if params else collective_device(group)


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least float32: bf16 and fp16 sums of squares lose most of their digits; float64 keeps its own.
    return torch.promote_types(dtype, torch.float32)


def global_grad_norm(
    owned: Sequence[nn.Parameter],
    replicated: Sequence[nn.Parameter],
    norm_type: float,
    pp_group: dist.ProcessGroup | None,
    count_replicated: bool,
) -> torch.Tensor:
    """The ``norm_type``-norm of the whole model's gradient across the pipeline, the same on every rank: float32, or
    float64 on a rank that holds float64 parameters (as ``torch.nn.utils.get_total_norm`` gives).

    Each stage contributes ‖owned grads‖_p^p; the replicated grads (equal everywhere after :func:`sum_over_pipeline`)
    are counted once, by the one stage passing ``count_replicated=True``. The contributions are summed (maxed for
    p = inf) over ``pp_group`` in float64, whatever each stage's dtype; None grads are skipped; ``pp_group`` None means
    this rank holds the whole model.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    owned, replicated = trainable(owned), trainable(replicated)
    owned_ids = {id(p) for p in owned}
    counted = owned + ([p for p in replicated if id(p) not in owned_ids] if count_replicated else [])
    device = _norm_device(owned + replicated, pp_group)
    # Keyed on the parameters, not their grads: the dtype must not depend on which grads this step produced.
    dtype = functools.reduce(torch.promote_types, [_norm_dtype(p.dtype) for p in owned + replicated], torch.float32)
    # A split parameter (a DTensor: FSDP's shard, a tensor-parallel part) contributes its local part here, counted
    # once along the mesh dimensions that replicate it; the parts are then reduced over each DTensor mesh.
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    local = _local_share([p for p in counted if not isinstance(p, DTensor)], norm_type, device, dtype)
    for mesh, split in _by_mesh([p for p in counted if isinstance(p, DTensor)]).items():
        shared = _local_share([p for p in split if _counted_here(p)], norm_type, device, dtype).to(torch.float64)
        for dim in range(mesh.ndim):
            dist.all_reduce(shared, op=op, group=mesh.get_group(dim))
        local = torch.stack([local, shared.to(dtype)]).max() if math.isinf(norm_type) else local + shared.to(dtype)
    if math.isinf(norm_type):
        return _over_pipeline(local, op, pp_group)
    return _over_pipeline(local, op, pp_group).pow(1.0 / norm_type)


def _local_share(params: Sequence[nn.Parameter], norm_type: float, device: torch.device, dtype: torch.dtype) -> Any:
    """Σ ‖g‖_p^p (max ‖g‖ for p = inf) over the grads of ``params`` held here (a sharded one's local shard)."""
    grads = [_held(p.grad) for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=_norm_dtype(g.dtype)).to(device, dtype) for g in grads]
    if not norms:
        return torch.zeros((), dtype=dtype, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its local part if split (a view: in-place changes reach the DTensor); a part
    still to be summed over some mesh dimension (``Partial``) summed first, into a new tensor."""
    if not isinstance(t, DTensor):
        return t
    if any(p.is_partial() for p in t.placements):
        t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
    return t.to_local()


def _by_mesh(params: Sequence[nn.Parameter]) -> dict[Any, list[nn.Parameter]]:
    """DTensor parameters by the mesh their gradients are split over, in the order of ``params``."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh, []).append(p)  # type: ignore[attr-defined]
    return groups


def _counted_here(p: Any) -> bool:
    """Whether this rank counts ``p``'s local part: its first copy along every mesh dimension that replicates it."""
    placements = p.grad.placements if isinstance(p.grad, DTensor) else p.placements
    mesh = p.device_mesh
    return all(mesh.get_local_rank(i) == 0 for i, pl in enumerate(placements) if not pl.is_shard())


def _over_pipeline(local: torch.Tensor, op: Any, pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local`` reduced by ``op`` over ``pp_group``, back in its own dtype.

    In float64 on every stage: the stages need not agree on a dtype (one without float64 parameters, or none at all,
    joins a float64 pipeline), a float64 model's norm keeps its digits, and a float32 one is rounded once, after.
    """
    if group_size(pp_group) == 1:
        return local
    total = local.to(torch.float64)
    dist.all_reduce(total, op=op, group=pp_group)
    return total.to(local.dtype)


def clip_grad_norm_(
    owned: Sequence[nn.Parameter],
    replicated: Sequence[nn.Parameter],
    max_norm: float,
    norm_type: float,
    pp_group: dist.ProcessGroup | None,
    count_replicated: bool,
) -> torch.Tensor:
    """Scale all grads (owned and replicated) so that the global norm is at most ``max_norm``; returns the norm
    before clipping (see :func:`global_grad_norm`)."""
    total = global_grad_norm(owned, replicated, norm_type, pp_group, count_replicated)
    params = trainable([*owned, *replicated])
    torch.nn.utils.clip_grads_with_norm_([p for p in params if not isinstance(p, DTensor)], max_norm, total)
    # The same scaling on the shards that clip_grads_with_norm_ applies (it cannot mix DTensors with tensors).
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor):  # its local part, in place (a Partial one too: the scaling is linear)
            grad.to_local().mul_(scale.to(grad.device))
    return total
