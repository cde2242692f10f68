"""Deferred BatchNorm: per-micro-batch normalization with running statistics updated once per mini-batch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe.pipe.rematerialize import is_recomputing
from lightning_gpipe.pipe.sync_batchnorm import Moments, merge_moments, sync_batch_norm

__all__ = [
    "DeferredBatchNorm",
    "check_replicas_run_the_same_m",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "deferred_statistics",
    "is_deferring",
    "revert_deferred_batch_norm",
    "sync_deferred_batch_norm",
]

_local = threading.local()

_AnyBatchNorm = TypeVar("_AnyBatchNorm", bound=_BatchNorm)

_BATCH_NORMS: dict[int, type[_BatchNorm]] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def is_deferring() -> bool:
    """True inside :func:`deferred_statistics` on this thread."""
    return getattr(_local, "deferring", False)


@contextlib.contextmanager
def deferred_statistics() -> Iterator[None]:
    """Mark a pipeline forward phase: DeferredBatchNorm accumulates statistics instead of updating running ones.

    The flag is thread-local, so every thread that runs a stage must enter it itself.
    """
    previous = is_deferring()
    _local.deferring = True
    try:
        yield
    finally:
        _local.deferring = previous


def _dims_of(ndim: int | None) -> int:
    # (N, C) and (N, C, L) are BatchNorm1d; anything unknown falls back to the most common, BatchNorm2d.
    return {2: 1, 3: 1, 4: 2, 5: 3}.get(ndim, 2) if ndim is not None else 2


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm that normalizes each micro-batch with its own statistics (as GPipe does) but updates the running
    statistics once per mini-batch, exactly as nn.BatchNorm would on the whole mini-batch.

    With :attr:`sync_group` set (see :func:`sync_deferred_batch_norm`), training normalizes micro-batch m with the
    statistics of the m-th micro-batches of all data-parallel replicas together, and the running statistics become
    those of the whole global mini-batch. These are collectives: every replica must run the same M micro-batches in
    the same schedule (recomputes included) and commit at the same point. Eval mode issues none.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        # Plain attributes, not buffers: the state dict must stay that of nn.BatchNorm. The d of the BatchNormNd
        # this layer replaced, or else the dimensions of its first input: what revert_deferred_batch_norm gives back.
        self._replaced_dims: int | None = None
        self._seen_ndim: int | None = None
        self.sync_group: dist.ProcessGroup | None = None
        self._reset_accumulators()

    def __getstate__(self) -> dict:
        # A process group can be neither pickled nor deep-copied: a copy starts unsynced, like a fresh layer.
        return {**super().__getstate__(), "sync_group": None}

    def _reset_accumulators(self) -> None:
        self._accumulated = False  # since the last commit; with sync, the replicas agree on this, not on the count
        self._count = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    def reset_running_stats(self) -> None:
        super().reset_running_stats()
        self._reset_accumulators()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self._replaced_dims is None:
            self._seen_ndim = input.dim()
        # A recompute re-runs a micro-batch of a deferred forward phase: normalize the same way, but never update.
        deferring = (is_deferring() or is_recomputing()) and self.training
        if self.sync_group is not None and self.training:
            return self._synced_forward(input, deferring)
        if not deferring or self.running_mean is None or self.running_var is None:
            return super().forward(input)
        # Normalize first: it rejects a micro-batch with a single value per channel before anything is accumulated.
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not is_recomputing():
            self._accumulate(input.detach())
        return output

    def _synced_forward(self, input: torch.Tensor, deferring: bool) -> torch.Tensor:
        # A recompute re-issues its micro-batch's collectives to get the same statistics again; that stays in step
        # because every replica recomputes the same micro-batches in the same order (same M, same schedule).
        assert self.sync_group is not None
        output, count, mean, var = sync_batch_norm(input, self.weight, self.bias, self.eps, self.sync_group)
        if self.running_mean is None or is_recomputing():
            return output
        if deferring:
            self._accumulate(input.detach())
        else:  # like nn.SyncBatchNorm: the running statistics of the global batch, at once
            with torch.no_grad():
                self._update_running(mean.double(), (var * (count / (count - 1).clamp_min(1))).double())
        return output

    @torch.no_grad()
    def _accumulate(self, x: torch.Tensor) -> None:
        self._accumulated = True
        n = x.numel() // x.shape[1]
        if n == 0:
            return
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.to(torch.float64), dim=dims, correction=0)
        m2 = var * n
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = n, mean, m2
            return
        # Chan et al.'s pairwise update; E[x²]−E[x]² would cancel catastrophically when |mean| ≫ std.
        total = self._count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + m2 + delta.square() * (self._count * n / total)
        self._count = total

    def _moments(self) -> Moments:
        # A replica that saw no value still joins the merge, with zeros.
        assert self.running_mean is not None, "only a layer that tracks running statistics accumulates"
        zeros = torch.zeros(self.num_features, dtype=torch.float64, device=self.running_mean.device)
        mean, m2 = (self._mean, self._m2) if self._mean is not None and self._m2 is not None else (zeros, zeros)
        return self._count, mean, m2

    @torch.no_grad()
    def _fold(self, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        self._reset_accumulators()
        if count > 0:
            # nn.BatchNorm tracks the unbiased variance; a lone value per channel never gets here (it is rejected).
            self._update_running(mean, m2 / max(count - 1, 1))

    def _update_running(self, mean: torch.Tensor, unbiased: torch.Tensor) -> None:
        assert self.running_mean is not None and self.running_var is not None
        # Mirrors nn.BatchNorm.forward, including its factor when num_batches_tracked is missing.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        for buffer, value in ((self.running_mean, mean), (self.running_var, unbiased)):
            updated = buffer.to(torch.float64) * (1.0 - factor) + value.to(buffer.device) * factor
            buffer.copy_(updated.to(buffer.dtype))

    def commit(self) -> None:
        """Fold the accumulated micro-batches into the running statistics as one nn.BatchNorm step, then reset.

        With :attr:`sync_group` set this is a collective (see :func:`commit_deferred_batch_norm`).
        """
        commit_deferred_batch_norm(self)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module) -> nn.Module:
        """Replace every nn.BatchNorm1d/2d/3d inside ``module`` (or ``module`` itself) by a DeferredBatchNorm."""
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            converted = _rebuild(module, cls)
            converted._replaced_dims = next(d for d, kind in _BATCH_NORMS.items() if isinstance(module, kind))
            return converted
        for name, child in list(module.named_children()):
            module.add_module(name, cls.convert_deferred_batch_norm(child))
        return module


def _rebuild(source: _BatchNorm, kind: type[_AnyBatchNorm]) -> _AnyBatchNorm:
    # Built on meta, then handed the source's own parameters and buffers: optimizers and weight ties keep working.
    target = kind(
        source.num_features,
        eps=source.eps,
        momentum=source.momentum,
        affine=source.affine,
        track_running_stats=source.track_running_stats,
        device="meta",
    )
    target.weight = source.weight
    target.bias = source.bias
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(target, name, getattr(source, name))
    target.train(source.training)
    return target


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d inside ``module`` (or ``module`` itself) by a DeferredBatchNorm."""
    return DeferredBatchNorm.convert_deferred_batch_norm(module)


def revert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Replace every DeferredBatchNorm inside ``module`` (or ``module`` itself) by the nn.BatchNorm it stands for.

    Statistics accumulated but not committed are dropped.
    """
    if isinstance(module, DeferredBatchNorm):
        dims = module._replaced_dims if module._replaced_dims is not None else _dims_of(module._seen_ndim)
        return _rebuild(module, _BATCH_NORMS[dims])
    for name, child in list(module.named_children()):
        module.add_module(name, revert_deferred_batch_norm(child))
    return module


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commit the accumulated statistics of every DeferredBatchNorm inside ``module``.

    Layers with a :attr:`~DeferredBatchNorm.sync_group` first merge their statistics over it, in one all_gather per
    group: every replica must call this at the same point (after each forward phase) with the same layers.
    """
    synced: dict[int, tuple[dist.ProcessGroup, list[DeferredBatchNorm]]] = {}
    for bn in module.modules():
        if not isinstance(bn, DeferredBatchNorm) or not bn._accumulated:
            continue
        if bn.sync_group is None:
            bn._fold(*bn._moments())
        else:
            synced.setdefault(id(bn.sync_group), (bn.sync_group, []))[1].append(bn)
    for group, norms in synced.values():
        for bn, moments in zip(norms, merge_moments([bn._moments() for bn in norms], group)):
            bn._fold(*moments)


def check_replicas_run_the_same_m(module: nn.Module, M: int, device: torch.device) -> None:
    """Synced BatchNorm issues collectives per micro-batch: replicas running different M would fall out of step and
    wait until the timeout, so they first compare M (one all_gather per group, only while a synced layer trains)."""
    groups = {
        id(bn.sync_group): bn.sync_group
        for bn in module.modules()
        if isinstance(bn, DeferredBatchNorm) and bn.sync_group is not None and bn.training
    }
    for group in groups.values():
        mine = torch.tensor([M], device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        counts = [int(t.item()) for t in every]
        if len(set(counts)) > 1:
            raise ValueError(
                f"sync_batchnorm: the data-parallel replicas would split their batches into different numbers of "
                f"micro-batches (M = {counts}, one per replica), and synced BatchNorm needs the same M on every "
                "replica. A replica got fewer samples than chunks: give every replica the same batch size (Lightning's "
                "DistributedSampler does; drop_last=True avoids a short last batch), or lower chunks"
            )


def sync_deferred_batch_norm(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Synchronize every DeferredBatchNorm inside ``module`` over the data-parallel ``group`` (None or a group of one
    rank turns it off); returns how many layers were set.

    Pass the group of the replicas of this stage, the ranks holding the same layers in the other pipelines.
    """
    if group is not None and dist.get_world_size(group) <= 1:
        group = None
    norms = [bn for bn in module.modules() if isinstance(bn, DeferredBatchNorm)]
    for bn in norms:
        bn.sync_group = group
    return len(norms)
