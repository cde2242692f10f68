"""The balance tests' tiny data and a backbone whose split differs by parameters and by FLOPs."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

D, N_SAMPLES, BATCH, STEPS, LR = 8, 64, 8, 3, 0.1  # 3 steps within the first epoch at dp 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N_SAMPLES, D, generator=g), torch.randn(N_SAMPLES, D, generator=g))


SPREAD = 32


class Spread(nn.Module):
    """(N, D) → (N, 32, D): no parameters, but the Linear after it does 32 times the FLOPs of one on (N, D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).repeat(1, SPREAD, 1)


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def uneven_backbone() -> nn.Sequential:
    """The exact split at K=2 is [3, 4] by parameters (Spread and Pool have none) and [5, 2] by FLOPs."""
    torch.manual_seed(11)
    return nn.Sequential(*[nn.Linear(D, D) for _ in range(4)], Spread(), nn.Linear(D, D), Pool())


class Uneven(pl.LightningModule):
    def __init__(self, example: bool = True) -> None:
        super().__init__()
        self.backbone = uneven_backbone()
        if example:
            self.example_input_array = torch.randn(BATCH, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)
