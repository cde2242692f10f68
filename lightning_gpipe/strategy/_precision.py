"""GPipeStrategy's precision hooks: one loss-scaling decision for every stage, clipping by the whole model's norm."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_gpipe.pipe.grads import clip_grad_norm_
from lightning_gpipe.strategy._weight_copies import WeightCopies


class PrecisionHooks:
    """Mixed into GPipeStrategy: what its precision plugin needs to see the pipeline as one model."""

    precision_plugin: Any
    root_device: torch.device
    _copies: WeightCopies | None
    _pp_group: Any

    def _agree_on_loss_scaling(self) -> None:
        """16-mixed: a stage that finds an inf must make every stage skip the step, not only itself."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or isinstance(scaler, ShardedGradScaler):
            return
        # ShardedGradScaler all-reduces found_inf over the world group (pipeline stages and replicas alike).
        self.precision_plugin.scaler = ShardedGradScaler(  # type: ignore[attr-defined]
            device=self.root_device.type,
            init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
            backoff_factor=scaler.get_backoff_factor(),
            growth_factor=scaler.get_growth_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        assert self._copies is not None
        counted, copies = self._copies.split_for_norm(list(self.precision_plugin.main_params(optimizer)))
        clip_grad_norm_(counted, copies, clip_val, 2.0, self._pp_group, count_replicated=False)
