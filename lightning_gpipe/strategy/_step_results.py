"""Loss-only output mode: a step's returned values, logged values and torchmetrics states come from the last stage."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

_BUCKET = 16 * 2**20


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _result_tensors(results: Any) -> list[torch.Tensor]:
    """The tensors behind every ``self.log`` entry: running value, batch-size weight and this step's value."""
    out: list[torch.Tensor] = []
    for metric in results.values() if results is not None else ():
        if not metric.is_tensor:
            continue  # a logged torchmetrics object: its states are synchronized as one of the module's metrics
        out.append(metric.value)
        if metric.meta.is_mean_reduction:
            out.append(metric.cumulated_batch_size)
        if isinstance(metric._forward_cache, torch.Tensor):
            out.append(metric._forward_cache)
    return out


def _metric_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every torchmetrics state of ``module`` (tensors and the items of list states) and their last forward value."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return []
    out: list[torch.Tensor] = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            for name in metric._defaults:
                leaves, _ = tree_flatten(getattr(metric, name))
                out.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
            cache, _ = tree_flatten(metric._forward_cache)
            out.extend(leaf for leaf in cache if isinstance(leaf, torch.Tensor))
    return out


def _describe(results: Any, tensors: list[torch.Tensor]) -> list[Any]:
    keys = list(results.keys()) if results is not None else []
    return [keys, [(tuple(t.shape), str(t.dtype)) for t in tensors]]


def _check_same_structure(described: list[Any], group: Any, last: int, device: torch.device) -> None:
    """Every stage must log, return and update the same things: otherwise the broadcast would pair unrelated values
    (a wrong key on rank 0) or send different sizes (gloo aborts). One 8-byte all-gather per step says so first."""
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little") >> 1], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    differ = [k for k, g in enumerate(gathered) if not torch.equal(g, gathered[last])]
    if not differ:
        return
    everyone: list[Any] = [None] * len(gathered)
    dist.all_gather_object(everyone, described[0], group=group)
    raise RuntimeError(
        f"GPipeStrategy(output='placeholder'): stage(s) {differ} logged, returned or updated other values than the "
        f"last stage in this step (logged keys {everyone[differ[0]]} vs the last stage's {everyone[last]}). With "
        "output='placeholder' the other stages compute on zeros, so what a step logs (its keys and how many values), "
        "returns and feeds to metrics must not depend on the backbone's output values "
        "(e.g. `if acc > 0.5: self.log(...)`); "
        "log the same keys every step, or use GPipeStrategy(output='all')"
    )


def take_from_last_stage(step_output: Any, module: Any, group: Any, last: int, device: torch.device) -> Any:
    """Overwrite this rank's logged values and metric states with the last stage's, and return its step output.

    The other stages computed them from placeholder zeros. Every stage ran the same code on same-shaped values, so
    the tensors line up one to one (checked first); one coalesced broadcast per step (scalars, mostly) replaces them
    in place.
    """
    results = module.trainer._results
    source = dist.get_rank(group) == last
    # The last stage's own loss keeps its graph (it drives the backward phase); the others get detached copies.
    returned = step_output if source else tree_map(lambda t: t.detach().clone() if _is_tensor(t) else t, step_output)
    returned_tensors = [t for t in tree_flatten(returned)[0] if _is_tensor(t)]
    states = _result_tensors(results) + _metric_tensors(module)
    # Several entries may share one tensor (a value logged on_step only is also its forward cache).
    unique = list({id(t): t for t in states}.values())
    tensors = returned_tensors + unique
    _check_same_structure(_describe(results, tensors), group, last, device)
    if source:  # the broadcast writes into its tensors even on the source: those may share a graph's storage
        tensors = [t.detach().clone() for t in tensors]
    if tensors:
        dist._broadcast_coalesced(group, tensors, _BUCKET, last)
    return returned
