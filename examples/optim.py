"""Optimizer pieces the example tasks share: no weight decay on norms and biases, LR schedules, the global batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

DecaySchedule = Literal["exponential", "step", "constant"]


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: weight decay on weight matrices and filters, none on BatchNorm/LayerNorm and biases.

    As in "ImageNet in four minutes" (Jia et al.): regularizing the normalization's scale and shift and the biases
    only hurts, and LARS-style large-batch training is sensitive to it. One-dimensional parameters are exactly those.
    """
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def warmup_then_decay(
    warmup_steps: int, decay: float, decay_steps: float, schedule: DecaySchedule = "exponential"
) -> Callable[[int], float]:
    """LR factor per optimizer step: linear warm-up from ~0 to 1, then ``decay`` per ``decay_steps`` steps.

    ``"exponential"`` decays smoothly (decay ** (t / decay_steps)), ``"step"`` in stairs (TensorFlow's staircase),
    ``"constant"`` not at all. t counts from the end of the warm-up.
    """
    if warmup_steps < 0 or decay_steps <= 0 or not 0 < decay <= 1:
        raise ValueError(
            f"need warmup_steps >= 0, decay_steps > 0 and 0 < decay <= 1; got warmup_steps={warmup_steps}, "
            f"decay_steps={decay_steps}, decay={decay}"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / decay_steps
        if schedule == "constant":
            return 1.0
        return decay ** (math.floor(t) if schedule == "step" else t)

    return factor


def inverse_sqrt(warmup_steps: int) -> Callable[[int], float]:
    """LR factor of "Attention Is All You Need": linear warm-up to 1 at ``warmup_steps``, then ∝ 1/√step."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")

    def factor(step: int) -> float:
        s = step + 1
        return min(s / warmup_steps, math.sqrt(warmup_steps / s))

    return factor


def _train_loader(trainer: Any) -> Any:
    """The train DataLoader, set up now if the fit loop has not yet (configure_optimizers runs before it does)."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    return trainer.train_dataloader


def global_batch_size(trainer: Any) -> int:
    """Samples per optimizer step over all data-parallel replicas (pipeline stages share one batch)."""
    loader = _train_loader(trainer)
    per_replica = getattr(loader, "batch_size", None)
    if per_replica is None:
        sampler = getattr(loader, "batch_sampler", None)
        per_replica = getattr(sampler, "batch_size", None)
    if not isinstance(per_replica, int):
        raise ValueError(
            "cannot tell the training batch size from the train DataLoader (no batch_size attribute); give it one, "
            "or set the learning rate scaling off (lr_batch_size=None)"
        )
    kwargs = getattr(trainer, "distributed_sampler_kwargs", None) or {}
    replicas = kwargs.get("num_replicas", trainer.world_size)
    return per_replica * replicas * trainer.accumulate_grad_batches


def steps_per_epoch(trainer: Any) -> int:
    """Optimizer steps per training epoch (sets up the training data if the loop has not yet)."""
    _train_loader(trainer)
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        raise ValueError("the training data has no length; give the schedule in steps instead of epochs")
    return max(1, math.ceil(batches / trainer.accumulate_grad_batches))
