"""The tiny strategy-test module and quiet Trainer on the standalone ``pytorch_lightning`` package.

``pytorch_lightning.Trainer`` takes only ``pytorch_lightning`` modules and strategies, so the module of
``tests.helpers.tiny_fit`` is written again on that package: the same ``Net`` (names, initial weights), steps and loss.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.tiny_fit import BATCH, LR, Net, dataset


class Tiny(pl.LightningModule):
    """``tiny_fit.TinyPipelined`` on ``pytorch_lightning``."""

    def __init__(self) -> None:
        super().__init__()
        net = Net()  # the same names and initial weights as tiny_fit's modules and reference
        self.prefix, self.backbone, self.head = net.prefix, net.backbone, net.head

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.head(self.backbone(self.prefix(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class TinyHooked(Tiny):
    """``tiny_fit.TinyHooked`` on ``pytorch_lightning``: the loss as ``pipeline_loss``, run inside the pipeline."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self.backbone(self.prefix(batch[0])), batch)
        self.log("train_loss", loss)
        return loss

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.head(output), batch[1])


def tiny(hooked: bool = False) -> Tiny:
    return TinyHooked() if hooked else Tiny()


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """``tests.helpers.launch.quiet_trainer`` for ``pytorch_lightning``: CPU, no files, no printing; ``kwargs`` win."""
    quiet = {
        "accelerator": "cpu",
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **kwargs})


def single_device_reference(steps: int, hooked: bool = False) -> dict[str, torch.Tensor]:
    """A plain one-process ``pytorch_lightning`` fit of ``Tiny``, on the order of batches that a one-replica
    pipelined run gets from the DistributedSampler Lightning injects (shuffled, seed 0); its final parameters."""
    module = tiny(hooked)
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    with warnings.catch_warnings():  # as in the pipelined workers: tiny-run advice, torch deprecations
        warnings.simplefilter("ignore")
        quiet_trainer(devices=1, max_steps=steps).fit(module, DataLoader(dataset(), batch_size=BATCH, sampler=sampler))
    return {name: p.detach().clone() for name, p in module.named_parameters()}
