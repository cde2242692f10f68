"""Input checks of GPipeStrategy: each raises one error that names the problem and the fix, before any work."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.schedule import CHECKPOINT_MODES
from lightning_gpipe.pipe.train_step import SCHEDULES
from lightning_gpipe.strategy._balance import BALANCE_NAMES
from lightning_gpipe.strategy._batch_check import CHECK_BATCHES


def check_strategy_args(
    chunks: Any,
    pipeline_parallel_size: Any,
    checkpoint: Any,
    output: Any,
    batch_dim: Any,
    check_batches: Any,
    balance: Any = "auto",
) -> None:
    """GPipeStrategy's own arguments, at construction."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"GPipeStrategy(chunks={chunks!r}): chunks, M, must be an int ≥ 1")
    if pipeline_parallel_size != "auto" and (not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1):
        raise ValueError(f"GPipeStrategy(pipeline_parallel_size={pipeline_parallel_size!r}): give an int ≥ 1 or 'auto'")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"GPipeStrategy(checkpoint={checkpoint!r}): choose one of {list(CHECKPOINT_MODES)}")
    if output not in ("all", "placeholder"):
        raise ValueError(f"GPipeStrategy(output={output!r}): choose 'all' or 'placeholder'")
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(
            f"GPipeStrategy(batch_dim={batch_dim!r}): the dimension that holds the samples, an int ≥ 0 (0 batch-first, "
            "1 for time-major (T, N, ...) tensors)"
        )
    if check_batches not in CHECK_BATCHES:
        raise ValueError(
            f"GPipeStrategy(check_batches={check_batches!r}): choose one of {list(CHECK_BATCHES)} (when the stages "
            "of a pipeline compare the batches they loaded: the first training step of each epoch, every one, or none)"
        )
    # Layer counts are checked against the backbone at setup, when its length and K are known.
    if isinstance(balance, str) and balance not in BALANCE_NAMES:
        raise ValueError(
            f"GPipeStrategy(balance={balance!r}): choose one of {list(BALANCE_NAMES)}, a list of layer counts per "
            "stage, or a cost function fn(index, layer) -> cost"
        )


def check_loss_path(micro_batch_loss: Any, schedule: Any) -> None:
    """Where the loss runs, and in which order the micro-batches go when it runs inside the pipeline."""
    if micro_batch_loss not in (True, False, "auto"):
        raise ValueError(
            f"GPipeStrategy(micro_batch_loss={micro_batch_loss!r}): choose 'auto' (inside the pipeline when the module "
            "defines pipeline_loss), True or False"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"GPipeStrategy(schedule={schedule!r}): choose one of {list(SCHEDULES)}")


def check_world_size(K: int, world_size: int, num_nodes: int, num_processes: int) -> None:
    """K must divide the world, once the processes are known."""
    if world_size % K:
        raise ValueError(
            f"GPipeStrategy(pipeline_parallel_size={K}) does not divide the world size {world_size} "
            f"({num_nodes} node(s) × {num_processes} process(es)); choose a K that divides it, or 'auto'"
        )


def find_backbone(module: nn.Module, path: str) -> tuple[nn.Module, str, nn.Sequential | GPipeStage]:
    """The module at the dotted ``path``, its parent and attribute name; it must be an nn.Sequential."""
    *parents, name = path.split(".")
    parent: nn.Module | None = module
    for attr in parents:
        parent = getattr(parent, attr, None)
        if parent is None:
            break
    found = getattr(parent, name, None) if parent is not None else None
    if found is None:
        sequential = [n for n, m in module.named_modules() if isinstance(m, nn.Sequential) and n]
        # Only the outermost ones: layers inside a Sequential are not candidates for a backbone.
        candidates = [n for n in sequential if not any(n.startswith(f"{o}.") for o in sequential)]
        raise AttributeError(
            f"GPipeStrategy(backbone={path!r}): {type(module).__name__} has no attribute {path!r}. "
            f"nn.Sequential attributes found: {candidates or 'none'}; pass one of them as GPipeStrategy(backbone=...)"
        )
    if not isinstance(found, nn.Sequential | GPipeStage):
        raise TypeError(
            f"GPipeStrategy(backbone={path!r}) is a {type(found).__name__}, not an nn.Sequential: "
            "express the part to pipeline as an nn.Sequential of layers"
        )
    assert parent is not None
    return parent, name, found


def reject_unsupported(module: nn.Module, backbone: str, *, sync_batchnorm: bool, deferred_batch_norm: bool) -> None:
    if type(module).__name__ == "OptimizedModule":
        raise TypeError(
            "GPipeStrategy cannot pipeline a torch.compile'd LightningModule: compile inside configure_model() instead"
        )
    if not sync_batchnorm:
        return
    # Refused rather than ignored: replicas would silently normalize with their own statistics.
    if not deferred_batch_norm:
        raise ValueError(
            "Trainer(sync_batchnorm=True) with GPipeStrategy synchronizes its deferred BatchNorm layers; "
            "set GPipeStrategy(deferred_batch_norm=True) or drop sync_batchnorm"
        )
    outside = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not name.startswith(f"{backbone}.")
    ]
    if outside:
        raise ValueError(
            f"Trainer(sync_batchnorm=True): GPipeStrategy synchronizes the BatchNorm layers of self.{backbone} over "
            f"the data-parallel replicas, but these are outside it: {outside}; move them into the backbone or drop "
            "sync_batchnorm"
        )


def reject_closure_replaying_optimizers(optimizers: list[Any]) -> None:
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "GPipeStrategy cannot run LBFGS: it re-evaluates the closure a data-dependent number of times, and "
                "every evaluation is a pipeline step all stages must take together; use a first-order optimizer"
            )
