"""A LightningCLI entry point for the CLI tests: the tiny pipelined model and data of tests/test_strategy.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from test_strategy import BATCH, Net, dataset


class TinyPipelined(pl.LightningModule):
    def __init__(self, lr: float = 0.1, report: str = "") -> None:
        super().__init__()
        net = Net()
        self.prefix, self.backbone, self.head = net.prefix, net.backbone, net.head
        self.lr, self.report = lr, report

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.head(self.backbone(self.prefix(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH)

    def on_fit_end(self) -> None:
        if self.report:
            strategy = self.trainer.strategy
            facts = {"chunks": strategy.chunks, "K": strategy.pipeline_parallel_size, "stage": strategy.stage.stage}
            Path(f"{self.report}.{self.global_rank}").write_text(json.dumps(facts))


if __name__ == "__main__":
    LightningCLI(TinyPipelined, save_config_callback=None)
