"""What a step leaves behind: an error on one stage aborts every stage; with output="placeholder", the last stage's."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage, PipelineError
from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_map
from lightning_gpipe.strategy._lightning_internals import broadcast_coalesced, forward_cache, logged_values

_BUCKET = 16 * 2**20


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _metric_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every torchmetrics state of ``module`` (tensors and the items of list states) and their last forward value."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return []
    out: list[torch.Tensor] = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            leaves, _ = tree_flatten(list(metric.metric_state.values()))
            out.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
            cache, _ = tree_flatten(forward_cache(metric))
            out.extend(leaf for leaf in cache if isinstance(leaf, torch.Tensor))
    return out


def _describe(keys: list[str], tensors: list[torch.Tensor]) -> list[Any]:
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


@contextmanager
def abort_on_error(stage: GPipeStage) -> Iterator[None]:
    try:
        yield
    except PipelineError:
        raise
    except Exception as e:
        # An error on one stage only (in the loss, say) must not leave the other stages waiting for it.
        stage.abort(e)


def from_last_stage(
    step_output: Any, stage: GPipeStage, module: pl.LightningModule, group: dist.ProcessGroup, device: torch.device
) -> Any:
    """``output="placeholder"``: the other stages computed on zeros; the last stage's values replace theirs."""
    if stage.output_mode != "placeholder" or stage.num_stages == 1:
        return step_output
    return take_from_last_stage(step_output, module, group, stage.num_stages - 1, device)


def take_from_last_stage(
    step_output: Any, module: pl.LightningModule, group: dist.ProcessGroup, last: int, device: torch.device
) -> Any:
    """Overwrite this rank's logged values and metric states with the last stage's, and return its step output.

    The other stages computed them from placeholder zeros. Every stage ran the same code on same-shaped values, so
    the tensors line up one to one (checked first); one coalesced broadcast per step (scalars, mostly) replaces them
    in place.
    """
    keys, logged = logged_values(module.trainer)
    source = dist.get_rank(group) == last
    # The last stage's own loss keeps its graph (it drives the backward phase); the others get detached copies.
    returned = step_output if source else tree_map(lambda t: t.detach().clone() if _is_tensor(t) else t, step_output)
    returned_tensors = [t for t in tree_flatten(returned)[0] if _is_tensor(t)]
    states = logged + _metric_tensors(module)
    # Several entries may share one tensor (a value logged on_step only is also its forward cache).
    unique = list({id(t): t for t in states}.values())
    tensors = returned_tensors + unique
    _check_same_structure(_describe(keys, tensors), group, last, device)
    if source:  # the broadcast writes into its tensors even on the source: those may share a graph's storage
        tensors = [t.detach().clone() for t in tensors]
    if tensors:
        broadcast_coalesced(group, tensors, _BUCKET, last)
    return returned
