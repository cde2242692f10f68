"""The user's random stream under GPipeStrategy is the one a run without a pipeline sees: the pipeline's step seeds
come from its own stream (``pipe.rng.StepSeeds``), so ``torch.randn`` in ``training_step`` and in a hook draws, at
every step and on every stage, what it draws under ``Trainer(devices=1, strategy="ddp")`` (whose setup, like this
strategy's, re-seeds from ``seed_everything``'s seed)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyHooked, TinyPipelined, dataset


def drawing(base: type[pl.LightningModule]) -> type[pl.LightningModule]:
    class Drawing(base):  # type: ignore[valid-type, misc]
        """Draws from the global generator in training_step and after each batch, as noise or augmentation would."""

        def __init__(self) -> None:
            super().__init__()
            self.draws: list[list[float]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.draws.append(torch.randn(2).tolist())
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, *args: Any) -> None:
            self.draws.append(torch.rand(1).tolist())

    return Drawing


def worker(rank: int, world_size: int, pipelined: bool, hooked: bool) -> list[list[float]]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    pl.seed_everything(3, verbose=False)
    module = drawing(TinyHooked if hooked else TinyPipelined)()
    strategy = GPipeStrategy(chunks=3, backbone="backbone") if pipelined else "ddp"
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=4)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return module.draws


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hooked", [False, True])
def test_the_users_draws_are_those_of_a_run_without_a_pipeline(hooked: bool) -> None:
    (ddp,) = run_distributed(worker, 1, False, hooked, timeout=120, lightning=True)
    pipelined = run_distributed(worker, 2, True, hooked, timeout=200, lightning=True)
    assert len(ddp) == 8
    for rank, draws in enumerate(pipelined):
        assert draws == ddp, (rank, draws, ddp)
