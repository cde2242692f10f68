"""The tiny LightningModule of the strategy tests and its plain-torch reference run (pp, pp × dp)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests.helpers import models

TOL = 1e-6


N_SAMPLES, BATCH, STEPS, LR = 48, 6, 4, 0.1


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N_SAMPLES, models.D, generator=g), torch.randn(N_SAMPLES, models.D, generator=g))


class Net(nn.Module):
    """An embedding-like layer before the backbone and a head after it: both replicated on every stage."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.prefix = nn.Linear(models.D, models.D)
        self.backbone = models.mlp()
        self.head = nn.Linear(models.D, models.D)
        if tied:  # as a tied input embedding and output projection: used on the first and on the last stage
            self.head.weight = self.prefix.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(x)))


class TinyPipelined(pl.LightningModule):
    """The LightningModule of the strategy tests (and of the CLI test's entry point)."""

    def __init__(self, lr: float = LR, momentum: float = 0.0, tied: bool = False) -> None:
        super().__init__()
        net = Net(tied)  # the same names and initial weights as the reference
        self.prefix, self.backbone, self.head = net.prefix, net.backbone, net.head
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.head(self.backbone(self.prefix(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class TinyHooked(TinyPipelined):
    """The same, with its loss as ``pipeline_loss``: GPipeStrategy runs it inside the pipeline."""

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self.backbone(self.prefix(batch[0])), batch)
        self.log("train_loss", loss)
        return loss

    def pipeline_loss(self, output, batch):
        return F.mse_loss(self.head(output), batch[1])


class Logged(TinyHooked):
    """The same, logging a mean and a sum inside ``pipeline_loss``: values logged per micro-batch."""

    def pipeline_loss(self, output, batch):
        loss = super().pipeline_loss(output, batch)
        self.log("inner_loss", loss)
        self.log("inner_sum", (self.head(output) - batch[1]).square().sum(), reduce_fx="sum")
        return loss


def lightning_module(momentum: float = 0.0, tied: bool = False, hooked: bool = False) -> TinyPipelined:
    return (TinyHooked if hooked else TinyPipelined)(momentum=momentum, tied=tied)


def reference(dp: int, clip: float | None, tied: bool = False, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain torch; each step averages the gradients of the dp replicas' batches (DistributedSampler shards)."""
    net = Net(tied)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    # Lightning shuffles a training loader's injected DistributedSampler (seed 0, epoch 0).
    shards = [torch.tensor(list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0))) for d in range(dp)]
    for step in range(steps):
        opt.zero_grad()
        for shard in shards:
            idx = shard[step * BATCH : (step + 1) * BATCH]
            (F.mse_loss(net(x_all[idx]), y_all[idx]) / dp).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in net.named_parameters()}
