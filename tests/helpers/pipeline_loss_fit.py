"""The tiny module whose ``pipeline_loss`` logs values and updates a torchmetrics object, and its fit: pipelined on
the ranks, or the plain Trainer's run on the dp replicas' batches joined."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torchmetrics import MeanSquaredError

from tests.helpers.launch import quiet_trainer
from tests.helpers.tiny_fit import BATCH, STEPS, TinyPipelined, dataset

LOGGED = ("train_loss", "train_mse", "inner_l1", "inner_sum")


class HookModule(TinyPipelined):
    """TinyPipelined with its loss as ``pipeline_loss``: a torchmetrics object and values logged inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.train_mse = MeanSquaredError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        loss = self.pipeline_loss(self.backbone(self.prefix(x)), batch)
        self.log("train_loss", loss)
        return loss

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        _, y = batch
        pred = self.head(output)
        self.train_mse(pred, y)
        self.log("train_mse", self.train_mse, on_epoch=True)
        self.log("inner_l1", F.l1_loss(pred, y))
        self.log("inner_sum", (pred - y).abs().sum(), reduce_fx="sum")
        return F.mse_loss(pred, y)


class Shards(Sampler):
    """The plain run's batches: each step, the dp replicas' batches joined (what DistributedSampler gives each)."""

    def __init__(self, dp: int) -> None:
        self.shards = [list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0)) for d in range(dp)]

    def __iter__(self) -> Any:
        for step in range(len(self.shards[0]) // BATCH):
            for shard in self.shards:
                yield from shard[step * BATCH : (step + 1) * BATCH]

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)


def loader(devices: int, dp: int) -> DataLoader:
    """The pipelined run's loader (Lightning shards it over the dp replicas), or on one device the plain run's: each
    step the replicas' batches joined."""
    if devices > 1:
        return DataLoader(dataset(), batch_size=BATCH)
    return DataLoader(dataset(), batch_size=BATCH * dp, sampler=Shards(dp))


def fit(
    strategy: Any, devices: int, dp: int, accumulate: int, clip: float | None, kind: type = HookModule
) -> tuple[HookModule, dict]:
    module = kind()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )
    trainer.fit(module, loader(devices, dp))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return module, metrics
