"""Deferred BatchNorm: per-micro-batch normalization with running statistics updated once per mini-batch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_gpipe.pipe._torch_internals import BatchNormBase, forward_hooks_always_called, version
from lightning_gpipe.pipe.state.rematerialize import is_recomputing
from lightning_gpipe.pipe.state.sync_batchnorm import Moments, check_same_m, merge_moments, sync_batch_norm

__all__ = [
    "DeferredBatchNorm",
    "check_replicas_run_the_same_m",
    "commit_deferred_batch_norm",
    "convert_deferred_batch_norm",
    "defer_by_stand_ins",
    "deferral",
    "deferred_statistics",
    "is_deferred",
    "is_deferring",
    "revert_deferred_batch_norm",
    "sync_deferred_batch_norm",
]

_local = threading.local()
_BATCH_NORMS: dict[int, type[BatchNormBase]] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}

# Where a layer keeps its deferral: a plain attribute, so that state dicts stay those of the layer's own class.
_ATTRIBUTE = "_deferred_statistics"

# The argument names of the calls a layer's forward normalizes with, by position.
_SIGNATURES: dict[Callable[..., Any], tuple[str, ...]] = {
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    torch.batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"),
}
_DEFAULTS: dict[str, Any] = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def is_deferring() -> bool:
    """True inside :func:`deferred_statistics` on this thread."""
    return getattr(_local, "deferring", False)


@contextlib.contextmanager
def deferred_statistics() -> Iterator[None]:
    """Mark a pipeline forward phase: deferred BatchNorm layers accumulate statistics instead of updating running
    ones. The flag is thread-local, so every thread that runs a stage must enter it itself."""
    previous = is_deferring()
    _local.deferring = True
    try:
        yield
    finally:
        _local.deferring = previous


def _version(t: torch.Tensor | None) -> int:
    try:
        return -1 if t is None else version(t)
    except RuntimeError:  # an inference tensor has no version counter
        return -1


class _Deferral:
    """One layer's deferred statistics: the moments of its micro-batches since the last commit, and what its own
    forward would have done to its running statistics (the factor it passed, its num_batches_tracked after)."""

    def __init__(self) -> None:
        self.sync_group: dist.ProcessGroup | None = None
        self.open: _Open | None = None
        self.stand_ins = False  # deferred by its caller (defer_by_stand_ins)
        self.reset()

    def reset(self) -> None:
        self.accumulated = False  # since the last commit; with sync, the replicas agree on this, not on the count
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None
        self.factor = 0.0
        self.tracked: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # A process group can be neither pickled nor deep-copied: a copy starts unsynced, like a fresh layer.
        return {**self.__dict__, "sync_group": None, "open": None}

    @torch.no_grad()
    def accumulate(self, x: torch.Tensor, factor: float, unbiased: torch.Tensor | None = None) -> None:
        """Add micro-batch ``x``'s per-channel moments; ``unbiased``: its variance as the normalizing kernel
        computed it (saves a second pass over ``x``), else computed here."""
        self.factor = float(factor)
        n = x.numel() // x.shape[1]
        if n == 0:
            return
        dims = [0, *range(2, x.dim())]
        if unbiased is None:
            var, mean = torch.var_mean(x.to(torch.float64), dim=dims, correction=0)
            m2 = var * n
        else:
            # The mean in float64 (a float32 mean of values far from zero would lose the digits the merge's
            # deltas need); the within-micro-batch spread as the kernel summed it.
            mean = x.sum(dim=dims, dtype=torch.float64) / n
            m2 = unbiased.to(torch.float64) * (n - 1)
        self.add(n, mean, m2)

    def add(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Add the moments of a micro-batch of ``n`` values per channel (float64)."""
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        # Chan et al.'s pairwise update; E[x²]−E[x]² would cancel catastrophically when |mean| ≫ std.
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta.square() * (self.count * n / total)
        self.count = total

    def moments(self, layer: BatchNormBase) -> Moments:
        # A replica that saw no value still joins the merge, with zeros.
        assert layer.running_mean is not None, "only a layer that tracks running statistics accumulates"
        zeros = torch.zeros(layer.num_features, dtype=torch.float64, device=layer.running_mean.device)
        mean, m2 = (self.mean, self.m2) if self.mean is not None and self.m2 is not None else (zeros, zeros)
        return self.count, mean, m2


def deferral(module: nn.Module) -> _Deferral | None:
    """``module``'s deferred statistics (None: not deferred)."""
    return module.__dict__.get(_ATTRIBUTE)


def is_deferred(module: nn.Module) -> bool:
    """Whether ``module``'s running statistics are deferred (see :func:`convert_deferred_batch_norm`)."""
    return deferral(module) is not None


@torch.no_grad()
def _blend(buffer: torch.Tensor, value: torch.Tensor, factor: float) -> None:
    # nn.BatchNorm's update, in float64: the merged statistics must not lose the digits Chan's formula kept.
    buffer.copy_((buffer.to(torch.float64) * (1.0 - factor) + value.to(buffer.device) * factor).to(buffer.dtype))


class _Normalizations(TorchFunctionMode):
    """Active during a deferred layer's own forward: the batch normalizations that would update its running
    statistics normalize alike but leave them alone (their statistics are accumulated), or with :attr:`sync_group`
    use the statistics of the replicas together. Everything else the forward does runs as written."""

    def __init__(self, layer: BatchNormBase, state: _Deferral, deferring: bool) -> None:
        super().__init__()
        self.layer, self.state, self.deferring = layer, state, deferring

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        names = _SIGNATURES.get(func)
        if names is not None:
            call = {**_DEFAULTS, **dict(zip(names, args)), **kwargs}
            if call["training"] and call["running_mean"] is self.layer._buffers.get("running_mean"):
                return self._normalize(call["input"], call["weight"], call["bias"], call["eps"], call["momentum"])
        return func(*args, **kwargs)

    def _normalize(
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, factor: float
    ) -> torch.Tensor:
        state, layer = self.state, self.layer
        tracks = layer.running_mean is not None and layer.running_var is not None
        if state.sync_group is None:
            # Normalize first: it rejects a micro-batch with a single value per channel before anything accumulates.
            if not tracks or is_recomputing():
                return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
            assert layer.running_var is not None
            # Stand-in running statistics at momentum 1 take the kernel's own variance of the micro-batch; in half
            # precision they would round it, so half statistics take a second pass in float64 (``unbiased=None``).
            var = None
            if layer.running_var.dtype in (torch.float32, torch.float64):
                var = torch.ones_like(layer.running_var)
            mean = None if var is None else torch.zeros_like(var)
            output = F.batch_norm(x, mean, var, weight, bias, True, 1.0, eps)
            state.accumulate(x.detach(), factor, unbiased=var)
            return output
        # A recompute re-issues its micro-batch's collectives to get the same statistics again; that stays in step
        # because every replica recomputes the same micro-batches in the same order (same M, same schedule).
        output, count, mean, var = sync_batch_norm(x, weight, bias, eps, state.sync_group)
        if not tracks or is_recomputing():
            return output
        if self.deferring:
            state.accumulate(x.detach(), factor)
        else:  # like nn.SyncBatchNorm: the running statistics of the global batch, at once
            assert layer.running_mean is not None and layer.running_var is not None
            _blend(layer.running_mean, mean.double(), factor)
            _blend(layer.running_var, (var * (count / (count - 1).clamp_min(1))).double(), factor)
        return output


# A forward under way: interception, deferring?, num_batches_tracked before, running statistics and their versions.
_Open = tuple[_Normalizations, bool, torch.Tensor | None, list[tuple[torch.Tensor | None, int]]]


def _statistics(layer: BatchNormBase) -> list[tuple[torch.Tensor | None, int]]:
    return [(b, _version(b)) for b in (layer._buffers.get("running_mean"), layer._buffers.get("running_var"))]


def _before(layer: BatchNormBase, args: Any) -> None:
    state = deferral(layer)
    if state is None or not layer.training:
        return
    # A recompute re-runs a micro-batch of a deferred forward phase: normalize the same way, but never update.
    deferring = is_deferring() or is_recomputing()
    if state.sync_group is None and (not deferring or layer.running_mean is None):
        return
    tracked = layer._buffers.get("num_batches_tracked")
    if deferring and tracked is not None:
        # The forward counts its batch on a stand-in: the count, like the statistics, moves once per mini-batch.
        layer._buffers["num_batches_tracked"] = tracked.clone()
    mode = _Normalizations(layer, state, deferring)
    state.open = (mode, deferring, tracked, _statistics(layer))
    mode.__enter__()


def _after(layer: BatchNormBase, args: Any, output: Any) -> None:
    state = deferral(layer)
    if state is None or state.open is None:
        return
    mode, deferring, tracked, statistics = state.open
    state.open = None
    mode.__exit__(None, None, None)
    if not deferring:
        return
    if not is_recomputing() and layer.running_mean is not None:
        state.accumulated = True
        if tracked is not None:
            state.tracked = layer._buffers["num_batches_tracked"]
    if tracked is not None:
        layer._buffers["num_batches_tracked"] = tracked
    if any(b is not a or v != w for (a, v), (b, w) in zip(statistics, _statistics(layer))):
        raise RuntimeError(
            f"deferred_batch_norm: {type(layer).__qualname__}.forward updates its running statistics other than "
            "through F.batch_norm, so the pipeline cannot defer them to one update per mini-batch. Pass "
            "deferred_batch_norm=False to GPipeStrategy or GPipeStage: the layer then runs as written on each "
            "micro-batch, the same run as on one device at chunks=1; at chunks > 1 it updates its running "
            "statistics once per micro-batch, with that micro-batch's statistics"
        )


def _defer(layer: BatchNormBase) -> None:
    if is_deferred(layer):
        return
    object.__setattr__(layer, _ATTRIBUTE, _Deferral())
    # Inside the hooks the layer already has: those run outside the interception, as they would without it.
    layer.register_forward_pre_hook(_before)
    layer.register_forward_hook(_after, prepend=True, always_call=True)


def _unhook(layer: nn.Module) -> None:
    for hooks in (layer._forward_pre_hooks, layer._forward_hooks):
        for key in [key for key, h in hooks.items() if h in (_before, _after, _seen)]:
            del hooks[key]
            forward_hooks_always_called(layer).pop(key, None)


def _undefer(layer: nn.Module) -> None:
    layer.__dict__.pop(_ATTRIBUTE, None)
    layer.__dict__.pop(INPUTS, None)
    _unhook(layer)


# Where a layer deferred by stand-ins keeps the shapes of its inputs during one call of its caller (stand_ins.py).
INPUTS = "_deferred_inputs"


def _seen(layer: BatchNormBase, args: Any) -> None:
    # Traced into a compiled graph as a side effect: () at each call's start, so the graph's guards hold.
    setattr(layer, INPUTS, (*getattr(layer, INPUTS), args[0].shape))


def defer_by_stand_ins(layer: BatchNormBase) -> None:
    """Let the caller of deferred ``layer`` defer its statistics, with stand-in running statistics around each call
    (``pipe/state/stand_ins.py``), instead of this module's interception of its forward, which no compiled graph
    holds."""
    state = deferral(layer)
    assert state is not None, "only a deferred layer"
    if state.stand_ins:
        return
    _unhook(layer)
    state.stand_ins = True
    object.__setattr__(layer, INPUTS, ())
    layer.register_forward_pre_hook(_seen)


class DeferredBatchNorm(BatchNormBase):
    """BatchNorm that normalizes each micro-batch with its own statistics (as GPipe does) but updates the running
    statistics once per mini-batch, exactly as nn.BatchNorm would on the whole mini-batch; for input of any
    dimension ≥ 2. A pipeline defers every BatchNorm in place (:func:`convert_deferred_batch_norm`): this class is
    the same layer, deferred from the start.

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
        # A plain attribute, not a buffer: the dimensions of its first input, what revert_deferred_batch_norm gives.
        self._seen_ndim: int | None = None
        _defer(self)

    @property
    def sync_group(self) -> dist.ProcessGroup | None:
        state = deferral(self)
        return None if state is None else state.sync_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self._seen_ndim is None:
            self._seen_ndim = input.dim()
        return super().forward(input)

    def commit(self) -> None:
        """Fold the accumulated micro-batches into the running statistics as one nn.BatchNorm step, then reset.

        With :attr:`sync_group` set this is a collective (see :func:`commit_deferred_batch_norm`).
        """
        commit_deferred_batch_norm(self)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module) -> nn.Module:
        """Same as :func:`convert_deferred_batch_norm`."""
        return convert_deferred_batch_norm(module)


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Defer the running statistics of every BatchNorm inside ``module`` (or ``module`` itself), in place.

    Each layer keeps its class, its forward (a subclass's activation, as timm's ``BatchNormAct2d``, included), its
    parameters and buffers, and so its state-dict keys and every reference to it. Inside a pipeline's forward phase
    the batch normalization its forward runs (``F.batch_norm`` on its running statistics) normalizes with the
    micro-batch's statistics and accumulates them; the commit after the phase then updates the running statistics
    and ``num_batches_tracked`` as that forward would have on the whole mini-batch. Returns ``module``.
    """
    for layer in module.modules():
        if isinstance(layer, BatchNormBase):
            _defer(layer)
    return module


def revert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_deferred_batch_norm` in ``module`` (or ``module`` itself); a :class:`DeferredBatchNorm`
    is replaced by the nn.BatchNorm of the dimensions it saw (2d if none). Statistics not committed are dropped."""
    if isinstance(module, DeferredBatchNorm):
        return _rebuild(module, _BATCH_NORMS[{2: 1, 3: 1, 4: 2, 5: 3}.get(module._seen_ndim or 4, 2)])
    _undefer(module)
    for name, child in list(module.named_children()):
        module.add_module(name, revert_deferred_batch_norm(child))
    return module


def _rebuild(source: BatchNormBase, kind: type[BatchNormBase]) -> BatchNormBase:
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


def _deferred_layers(module: nn.Module) -> Iterator[tuple[BatchNormBase, _Deferral]]:
    for layer in module.modules():
        state = deferral(layer)
        if state is not None:
            assert isinstance(layer, BatchNormBase)
            yield layer, state


@torch.no_grad()
def _fold(layer: BatchNormBase, state: _Deferral, moments: Moments) -> None:
    count, mean, m2 = moments
    factor, tracked = state.factor, state.tracked
    state.reset()
    if count > 0 and layer.running_mean is not None and layer.running_var is not None:
        # nn.BatchNorm tracks the unbiased variance; a lone value per channel never gets here (it is rejected).
        _blend(layer.running_mean, mean, factor)
        _blend(layer.running_var, m2 / max(count - 1, 1), factor)
    if tracked is not None and layer.num_batches_tracked is not None:
        layer.num_batches_tracked.copy_(tracked)


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commit the accumulated statistics of every deferred BatchNorm inside ``module``.

    Layers with a :attr:`~DeferredBatchNorm.sync_group` first merge their statistics over it, in one all_gather per
    group: every replica must call this at the same point (after each forward phase) with the same layers.
    """
    synced: dict[int, tuple[dist.ProcessGroup, list[tuple[BatchNormBase, _Deferral]]]] = {}
    for layer, state in _deferred_layers(module):
        if not state.accumulated:
            continue
        if state.sync_group is None:
            _fold(layer, state, state.moments(layer))
        else:
            synced.setdefault(id(state.sync_group), (state.sync_group, []))[1].append((layer, state))
    for group, norms in synced.values():
        for (layer, state), moments in zip(norms, merge_moments([s.moments(bn) for bn, s in norms], group)):
            _fold(layer, state, moments)


def check_replicas_run_the_same_m(module: nn.Module, M: int, device: torch.device) -> None:
    """Synced BatchNorm issues collectives per micro-batch: replicas running different M would fall out of step and
    wait until the timeout, so they first compare M (one all_gather per group, only while a synced layer trains)."""
    groups = {id(g): g for bn, s in _deferred_layers(module) if (g := s.sync_group) is not None and bn.training}
    for group in groups.values():
        check_same_m(M, group, device)


def sync_deferred_batch_norm(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Synchronize every deferred BatchNorm inside ``module`` over the data-parallel ``group`` (None or a group of
    one rank turns it off); returns how many layers were set.

    Pass the group of the replicas of this stage, the ranks holding the same layers in the other pipelines.
    """
    if group is not None and dist.get_world_size(group) <= 1:
        group = None
    norms = list(_deferred_layers(module))
    if group is not None and (compiled := [type(bn).__name__ for bn, s in norms if s.stand_ins]):
        raise ValueError(
            f"sync_deferred_batch_norm: {compiled[0]} runs inside a compiled layer, which cannot issue the "
            "collectives that synchronize each micro-batch's statistics over the replicas. Leave the BatchNorm "
            "unsynchronized (drop Trainer(sync_batchnorm=True)) or compile the layers without BatchNorm only"
        )
    for _, state in norms:
        state.sync_group = group
    return len(norms)
