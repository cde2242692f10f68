"""Deferred BatchNorm inside compiled layers: stand-in running statistics swapped in around each layer's call.

Eager deferral (``batchnorm.py``) intercepts the ``F.batch_norm`` call of each layer's forward with a torch-function
mode entered from a hook; dynamo breaks the graph on both. Here the forward runs as written, compiled or not, and the
caller of the layer that holds the BatchNorm arranges what it updates instead. Around each call, in a pipeline's
forward phase or its recompute, every training BatchNorm inside gets:

* zeros as running statistics and momentum 1, so the kernel's own update leaves in them exactly the micro-batch's
  mean and unbiased variance, as eager deferral's stand-ins do;
* a copy of ``num_batches_tracked``, which its forward counts on;
* a forward pre-hook that notes its input's shape, which gives the count of values per channel.

After the call the real buffers go back, and the micro-batch's moments join the deferral (not in a recompute), with
the factor the forward would have used: ``momentum``, or 1 / ``num_batches_tracked`` where it is None, as
``nn.BatchNorm`` decides. The buffers are inputs of a compiled graph and the swapped attributes hold the same values
at each call's start, so no call recompiles. The micro-batch's mean is the kernel's, in the input's dtype (eager
deferral sums it in float64). A BatchNorm called twice in one call of its layer is refused: its stand-ins would hold
the last call's statistics only. Synchronized BatchNorm issues collectives per micro-batch and stays eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_gpipe.pipe._torch_internals import BatchNormBase
from lightning_gpipe.pipe.state.batchnorm import INPUTS, defer_by_stand_ins, deferral, is_deferred, is_deferring
from lightning_gpipe.pipe.state.rematerialize import is_recomputing

__all__ = ["deferred_norms", "standing_in"]


def deferred_norms(layer: nn.Module) -> list[BatchNormBase]:
    """The deferred BatchNorm layers inside ``layer``, switched to stand-ins (``batchnorm.defer_by_stand_ins``)."""
    norms = [m for m in layer.modules() if isinstance(m, BatchNormBase) and is_deferred(m)]
    for bn in norms:
        defer_by_stand_ins(bn)
    return norms


_Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float | None]


@contextlib.contextmanager
def standing_in(norms: list[BatchNormBase]) -> Iterator[None]:
    """Around one call of the layer that holds ``norms``: their statistics deferred (the module's docstring)."""
    recomputing = is_recomputing()
    if not norms or not (is_deferring() or recomputing):
        yield
        return
    saved: dict[BatchNormBase, _Saved] = {}
    for bn in norms:
        mean, var = bn._buffers.get("running_mean"), bn._buffers.get("running_var")
        if not bn.training or mean is None or var is None:
            continue
        tracked = bn._buffers.get("num_batches_tracked")
        saved[bn] = (mean, var, tracked, bn.momentum)
        bn._buffers["running_mean"], bn._buffers["running_var"] = torch.zeros_like(mean), torch.zeros_like(var)
        if tracked is not None:
            bn._buffers["num_batches_tracked"] = tracked.clone()
        bn.momentum = 1.0
    try:
        yield
    except BaseException:
        for bn, kept in saved.items():
            _restore(bn, kept)
        raise
    left = {bn: _restore(bn, kept) for bn, kept in saved.items()}
    if not recomputing:
        for bn, moments in left.items():
            _accumulate(bn, saved[bn][3], *moments)


def _restore(bn: BatchNormBase, saved: _Saved) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple]:
    """Put ``bn``'s own buffers and momentum back; what the call left in the stand-ins, and its inputs' shapes."""
    mean, var = bn._buffers["running_mean"], bn._buffers["running_var"]
    assert mean is not None and var is not None, "the stand-ins the call ran with"
    tracked = bn._buffers.get("num_batches_tracked")
    shapes: tuple = getattr(bn, INPUTS)
    object.__setattr__(bn, INPUTS, ())
    bn._buffers["running_mean"], bn._buffers["running_var"] = saved[0], saved[1]
    if saved[2] is not None:
        bn._buffers["num_batches_tracked"] = saved[2]
    bn.momentum = saved[3]
    return mean, var, tracked, shapes


def _accumulate(
    bn: BatchNormBase,
    momentum: float | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    tracked: torch.Tensor | None,
    shapes: tuple,
) -> None:
    if len(shapes) > 1:
        raise RuntimeError(
            f"deferred_batch_norm: a {type(bn).__name__} ran {len(shapes)} times in one call of its compiled layer, "
            "so its statistics cannot be deferred there (each call would overwrite the last). Compile the modules "
            "around it instead of the whole layer, or pass deferred_batch_norm=False"
        )
    if not shapes:  # not called this time (a branch of the forward)
        return
    state = deferral(bn)
    assert state is not None
    n = torch.Size(shapes[0]).numel() // shapes[0][1]
    if momentum is not None:
        state.factor = float(momentum)
    else:  # nn.BatchNorm's cumulative average
        state.factor = 0.0 if tracked is None else 1.0 / float(tracked)
    if n > 0:
        state.add(n, mean.to(torch.float64), var.to(torch.float64) * (n - 1))
    state.accumulated = True
    if tracked is not None:
        state.tracked = tracked
