"""GPipeStrategy's checkpoint hooks: each rank saves and restores only its own stage's layers and optimizer state."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gpipe.strategy import _checkpoint_files as checkpointing
from lightning_gpipe.strategy._rank_pipeline import RankPipeline


class CheckpointHooks(ParallelStrategy):
    """Lightning's checkpoint hooks for a pipeline: a torch.distributed.checkpoint folder or one file of the plain
    module's keys (``save_distributed_checkpoint``), restored in any layout after setup."""

    save_distributed_checkpoint: bool

    @property
    @abstractmethod
    def _rank_pipeline(self) -> RankPipeline: ...

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage must exist: each rank restores only its own layers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # save_checkpoint collects every rank's states itself

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("GPipeStrategy.save_checkpoint does not take storage_options (it has no CheckpointIO)")
        path = Path(self.broadcast(str(filepath)))
        assert self.model is not None
        pipeline = self._rank_pipeline
        sharded, order = self.save_distributed_checkpoint, pipeline.plain_parameter_names
        args = (self.global_rank, sharded, order, pipeline.stage, pipeline.mesh.K)
        checkpointing.save(checkpoint, path, self.model, self.optimizers, *args)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        return checkpointing.load(path, self.model, self.optimizers, strict, self._rank_pipeline.plain_parameter_names)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint
