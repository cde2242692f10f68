"""The user's random stream under GPipeStrategy is the one a run without a pipeline sees: the pipeline's step seeds
come from its own stream (``pipe.state.rng.StepSeeds``), so ``torch.randn`` in the training and validation steps and in
every hook of a fit draws, at every step and on every stage, what it draws under ``Trainer(devices=1,
strategy="ddp")`` (whose setup, like this strategy's, re-seeds from ``seed_everything``'s seed)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyHooked, TinyPipelined, dataset

HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_end",
)


def _drawing_hook(name: str) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.draws.append((name, torch.rand(1).item()))
        return getattr(super(type(self), self), name)(*args, **kwargs)

    return hook


def drawing(base: type[pl.LightningModule]) -> type[pl.LightningModule]:
    class Drawing(base):  # type: ignore[valid-type, misc]
        """Draws from the global generator in the steps and in every hook, as noise or augmentation would."""

        def __init__(self) -> None:
            super().__init__()
            self.draws: list[tuple[str, Any]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.draws.append(("training_step", torch.randn(2).tolist()))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.draws.append(("validation_step", torch.randn(2).tolist()))
            out = self.backbone(self.prefix(batch[0]))
            loss = self.pipeline_loss(out, batch) if hasattr(self, "pipeline_loss") else (self.head(out) - batch[1])
            self.log("val", loss.square().mean())

    for name in HOOKS:
        setattr(Drawing, name, _drawing_hook(name))
    return Drawing


def worker(rank: int, world_size: int, pipelined: bool, hooked: bool) -> list[tuple[str, Any]]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    pl.seed_everything(3, verbose=False)
    module = drawing(TinyHooked if hooked else TinyPipelined)()
    strategy = GPipeStrategy(chunks=3, backbone="backbone") if pipelined else "ddp"
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=4, val_check_interval=2)
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer.fit(module, loader, DataLoader(dataset(), batch_size=2 * BATCH))
    return module.draws


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hooked", [False, True])
def test_the_users_draws_are_those_of_a_run_without_a_pipeline(hooked: bool) -> None:
    (ddp,) = run_distributed(worker, 1, False, hooked, timeout=120, lightning=True)
    pipelined = run_distributed(worker, 2, True, hooked, timeout=200, lightning=True)
    assert {name for name, _ in ddp} == {*HOOKS, "training_step", "validation_step"}, ddp
    for rank, draws in enumerate(pipelined):
        assert draws == ddp, (rank, [(a, b) for a, b in zip(draws, ddp) if a != b][:3])
