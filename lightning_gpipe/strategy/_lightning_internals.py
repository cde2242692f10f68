"""Every private Lightning, torchmetrics and torch API the strategy relies on, named once: an upgrade fails here.

``tests/strategy/test_lightning_internals.py`` pins each of them (it exists, with the signature or behaviour relied
on). Kept here, and why no public API does it:

- ``SubprocessScriptLauncher``, ``init_dist_connection``, ``set_num_threads_if_needed``, ``optimizers_to_device``,
  ``sync_ddp_if_available``: what Lightning's own ModelParallelStrategy and DDPStrategy call to start processes, join
  the process group, share the cores, move optimizer states and reduce logged values; reimplementing them would
  drift from Lightning's behaviour (environment variables, logging, the gloo mean).
- ``layer_sync_requested``: ``Trainer(sync_batchnorm=True)`` reaches a strategy only as ``strategy._layer_sync``.
- ``set_device_mesh``: ``LightningModule.device_mesh`` is read-only; Lightning's strategies set ``_device_mesh``.
- ``logged_values``, ``forward_cache``: ``output="placeholder"`` copies every logged value and metric state from
  the last stage, which needs the tensors behind ``self.log`` (``Trainer._results``) and a metric's last forward
  value (torchmetrics ``Metric._forward_cache``); neither has a public accessor.
- ``set_forward_cache``, ``update_count``, ``local_compute``: the loss inside the pipeline updates metrics per
  micro-batch on the last stage and adds the step's increment to every rank's copy (``Metric.merge_state``, public);
  the step value, the count of updates and a compute without the cross-process sync have no public setter.
- ``broadcast_coalesced``: torch's ``dist._broadcast_coalesced`` (what DDP syncs module states with) broadcasts many
  small tensors (logged values, the weights copied on every stage) in a few buckets; the public ``broadcast`` is one
  collective per tensor.
- ``averaged_copies``: Lightning's ``WeightAveraging`` and ``StochasticWeightAveraging`` callbacks keep their copy
  of the module in ``_average_model``, made in their ``setup`` before the strategy's (so it holds the whole backbone);
  each rank's copy must follow its stage, and no public API reaches it.
- ``route_norm_clipping``: Lightning clips through the precision plugin, with a local norm and no strategy hook;
  a pipeline needs the norm of the whole model across stages.
- ``logger``: the strategy's messages go to a child of ``lightning.pytorch``'s logger, which Lightning configures
  (its level and handler, set in its ``__init__``): they print where Lightning's setup messages do.
- ``summarize_with``: the ``ModelSummary`` callback builds its summary in ``_summary`` (DeepSpeed's stage-3 summary
  is chosen there by strategy type, with no hook for other strategies); a pipeline's rank holds one stage, so the
  whole model's rows come from the split instead.
- Duck-typed by Lightning's accelerator connector, so no wrapper: it reads ``GPipeStrategy.is_distributed`` with
  ``hasattr`` for strategies it does not know (without it no DistributedSampler is injected), sets ``num_nodes`` and
  calls ``set_world_ranks()`` on any strategy that has them. The test pins these through a real Trainer.

Not counted as internals: the documented Strategy hooks GPipeStrategy overrides, and ``_configure_launcher`` with
``self._launcher``, the way every Lightning strategy picks its launcher. Public API replaced former uses of
internals: ``torch.distributed.is_initialized`` (``_distributed_is_initialized``), torch's
``Backend.default_device_backend_map`` (``_get_default_process_group_backend_for_device``), the ``optimizers`` and
``lr_scheduler_configs`` setters (``_reset_optimizers_and_schedulers``), ``predict_loop.return_predictions``
(``_return_predictions``) and torchmetrics' ``Metric.metric_state`` (``Metric._defaults``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh
    from torchmetrics import Metric

# Starts the other processes by re-running the user's script (torchrun's way), as DDPStrategy's default launcher.
SubprocessScriptLauncher = _SubprocessScriptLauncher
# Sets MASTER_ADDR/PORT from the cluster environment, then init_process_group(backend, rank, world_size, **kwargs).
init_dist_connection = _init_dist_connection
# torch's threads (and OMP_NUM_THREADS) set to the cores ÷ processes, unless OMP_NUM_THREADS is set.
set_num_threads_if_needed = _set_num_threads_if_needed
# all_reduce over a group; "mean" as a sum and a division where gloo has no AVG.
sync_ddp_if_available = _sync_ddp_if_available
# all_gather over a group into one stacked tensor (autograd through it with sync_grads).
all_gather_ddp_if_available = _all_gather_ddp_if_available
# Every optimizer's state tensors moved to the device (checkpoints restore them on the CPU).
optimizers_to_device = _optimizers_to_device


logger = logging.getLogger("lightning.pytorch.strategies.gpipe")


def broadcast_coalesced(group: dist.ProcessGroup, tensors: list[Tensor], bucket_bytes: int, src: int) -> None:
    """``tensors`` overwritten in place with group rank ``src``'s, flattened into buckets of ``bucket_bytes``."""
    dist._broadcast_coalesced(group, tensors, bucket_bytes, src)


__all__ = [
    "SubprocessScriptLauncher",
    "all_gather_ddp_if_available",
    "averaged_copies",
    "broadcast_coalesced",
    "forward_cache",
    "init_dist_connection",
    "layer_sync_requested",
    "logged_values",
    "optimizers_to_device",
    "route_norm_clipping",
    "set_device_mesh",
    "set_num_threads_if_needed",
    "sync_ddp_if_available",
]


def layer_sync_requested(strategy: ParallelStrategy) -> bool:
    """Whether ``Trainer(sync_batchnorm=True)`` was given: the accelerator connector sets ``_layer_sync`` then."""
    return strategy._layer_sync is not None


def set_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` (read in configure_model) return ``mesh``, as Lightning's strategies do."""
    module._device_mesh = mesh


def logged_values(trainer: pl.Trainer) -> tuple[list[str], list[Tensor]]:
    """The keys of the running loop's ``self.log`` entries, and the tensors behind them: each entry's running value,
    its batch-size weight (mean reduction) and this step's value.

    Relies on ``Trainer._results`` (the active loop's ``_ResultCollection``, a dict of ``_ResultMetric``) and on
    ``_ResultMetric.is_tensor``, ``.value``, ``.meta.is_mean_reduction``, ``.cumulated_batch_size`` and
    ``._forward_cache``.
    """
    results = trainer._results
    if results is None:
        return [], []
    out: list[Tensor] = []
    for metric in results.values():
        if not metric.is_tensor:
            continue  # a logged torchmetrics object: its states are synchronized as one of the module's metrics
        out.append(metric.value)
        if metric.meta.is_mean_reduction:
            out.append(metric.cumulated_batch_size)
        if isinstance(metric._forward_cache, torch.Tensor):
            out.append(metric._forward_cache)
    return list(results.keys()), out


def forward_cache(metric: Metric) -> Any:
    """The value ``metric``'s last forward call returned (torchmetrics keeps it as ``_forward_cache``)."""
    return metric._forward_cache


def set_forward_cache(metric: Metric, value: Any) -> None:
    """Make ``value`` the step value Lightning logs for ``metric`` (see :func:`forward_cache`)."""
    metric._forward_cache = value


def update_count(metric: Metric) -> int:
    """How many updates ``metric``'s state holds (``_update_count``; ``compute`` warns when it is 0)."""
    return metric._update_count


def set_update_count(metric: Metric, count: int) -> None:
    metric._update_count = count
    metric._computed = None  # the cached result of compute() belongs to the old state


def local_compute(metric: Metric) -> Any:
    """``metric.compute()`` on this process's state only, as ``forward`` computes its step value (``_to_sync``)."""
    to_sync = metric._to_sync
    metric._to_sync = metric.dist_sync_on_step
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._computed = to_sync, None


def route_norm_clipping(plugin: Precision, clip: Callable[[torch.optim.Optimizer, int | float], None]) -> None:
    """Make ``gradient_clip_algorithm="norm"`` call ``clip``: ``Precision.clip_gradients`` calls
    ``self.clip_grad_by_norm(optimizer, clip_val)`` for it, and the Trainer calls that for every clipping."""
    # An attribute of this instance only, shadowing the class's method: the plugin is the user's, not ours.
    setattr(plugin, "clip_grad_by_norm", clip)  # noqa: B010


def summarize_with(trainer: pl.Trainer, summary: Callable[[pl.LightningModule, int], Any]) -> None:
    """Make every ModelSummary callback (RichModelSummary too) build ``summary(module, max_depth)``."""
    from lightning.pytorch.callbacks import ModelSummary

    def build(depth: int) -> Callable[[pl.Trainer, pl.LightningModule], Any]:
        return lambda _, module: summary(module, depth)

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummary):
            callback._summary = build(callback._max_depth)  # type: ignore[method-assign,assignment]


def averaged_copies(module: torch.nn.Module) -> list[tuple[Any, str]]:
    """Where the weight-averaging callbacks of ``module``'s Trainer (none without one) hold their copy of it, as
    (holder, attribute): ``WeightAveraging`` an ``AveragedModel`` of it in ``_average_model`` (the copy is its
    ``module``), ``StochasticWeightAveraging`` a deepcopy of it there."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
    from torch.optim.swa_utils import AveragedModel

    trainer = getattr(module, "_trainer", None)  # LightningModule.trainer raises where none is attached
    found: list[tuple[Any, str]] = []
    for callback in [] if trainer is None else trainer.callbacks:
        average = getattr(callback, "_average_model", None)
        if isinstance(callback, WeightAveraging) and isinstance(average, AveragedModel):
            found.append((average, "module"))
        elif isinstance(callback, StochasticWeightAveraging) and isinstance(average, torch.nn.Module):
            found.append((callback, "_average_model"))
    return found
