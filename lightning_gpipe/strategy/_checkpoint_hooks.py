"""GPipeStrategy's checkpoint hooks: every rank saves and restores its own stage, under the plain module's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_gpipe.strategy import _checkpoint_files as checkpointing


class CheckpointHooks:
    """Mixed into GPipeStrategy (before ParallelStrategy): Lightning's checkpoint hooks for a pipelined module."""

    save_distributed_checkpoint: bool
    model: Any
    optimizers: list[torch.optim.Optimizer]
    lightning_module: Any
    global_rank: int
    is_global_zero: bool
    broadcast: Any
    barrier: Any
    # The plain module's parameter names in order, set by GPipeStrategy.setup before it pipelines the backbone.
    _plain_parameter_names: list[str] | None = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage must exist: each rank restores only its own layers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # save_checkpoint collects every rank's states itself

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "GPipeStrategy.save_checkpoint does not take storage_options (it does not use CheckpointIO)"
            )
        path = Path(self.broadcast(str(filepath)))
        assert self.model is not None
        # Both raise the same error on every rank when any rank fails: none is left waiting at a collective.
        if self.save_distributed_checkpoint:
            checkpointing.save_sharded(checkpoint, path, self.model, self.optimizers, self.global_rank)
        else:
            order = self._plain_parameter_names
            checkpointing.save_single_file(checkpoint, path, self.model, self.optimizers, self.global_rank, order)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        return checkpointing.load(path, self.model, self.optimizers, strict, self._plain_parameter_names)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint
