"""GPipeStrategy's teardown is Lightning's: the checkpoint plugin torn down, the module and optimizer states moved to
the CPU (as Lightning's own strategies leave them)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module


def teardown_worker(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    torn: list[str] = []

    class SpyIO(TorchCheckpointIO):
        def teardown(self) -> None:
            torn.append("checkpoint_io")

    moved: list[str] = []
    module = lightning_module()
    cpu = pl.LightningModule.cpu

    def spy_cpu(self: pl.LightningModule) -> pl.LightningModule:
        moved.append(type(self).__name__)
        return cpu(self)

    pl.LightningModule.cpu = spy_cpu  # type: ignore[method-assign]
    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=2)
    strategy.checkpoint_io = SpyIO()
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=2)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    pl.LightningModule.cpu = cpu  # type: ignore[method-assign]
    return {"torn": torn, "moved": moved}


@pytest.mark.timeout(200)
def test_teardown_tears_down_the_checkpoint_plugin_and_moves_the_module_to_the_cpu() -> None:
    for rank, r in enumerate(run_distributed(teardown_worker, 2, timeout=180, lightning=True)):
        assert r == {"torn": ["checkpoint_io"], "moved": ["TinyPipelined"]}, (rank, r)
