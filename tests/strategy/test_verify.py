"""``lightning_gpipe.verify``: a same run is called one, BatchNorm at M > 1 a difference by design, a layer that mixes
the samples of its batch and a layer that depends on its process are named as what they are."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.launch import run_distributed

STEPS = 4


class MinusBatchMean(nn.Module):
    """Mixes the samples of its batch: what a smaller (micro-)batch changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


class ByRank(nn.Module):
    """Depends on the process that runs it: what the split into stages changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + torch.distributed.get_rank()) if torch.distributed.is_initialized() else x


class Net(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        middle: list[nn.Module] = {
            "plain": [],
            "dropout_bn": [nn.Dropout(0.3), nn.BatchNorm1d(16)],
            "mixer": [MinusBatchMean()],
            "by_rank": [],
        }[kind]
        last = [ByRank()] if kind == "by_rank" else []
        self.backbone = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), *middle, nn.Linear(16, 16), nn.Tanh(), *last, nn.Linear(16, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.backbone(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x.double(), y.double()), batch_size=16, shuffle=True)


def worker(rank: int, world_size: int, kind: str, M: int) -> Any:
    """One verification per launch: as a user runs it (torch's device meshes outlive a process group)."""
    from lightning_gpipe import GPipeStrategy
    from lightning_gpipe.verify import verify

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    report = verify(lambda: Net(kind), data, GPipeStrategy(chunks=M, pipeline_parallel_size=2), steps=STEPS)
    return None if report is None else (report.verdict, report.explanation, report.losses, str(report))


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("kind", "M", "verdict"),
    [
        ("plain", 2, "same run"),
        ("dropout_bn", 1, "same run"),  # dropout off in every run; one micro-batch
        ("dropout_bn", 2, "by design"),
        ("mixer", 2, "mixes samples"),
        ("by_rank", 2, "different"),
    ],
)
def test_each_kind_of_difference_gets_its_verdict(kind: str, M: int, verdict: str) -> None:
    reports = run_distributed(worker, 2, kind, M, timeout=180, lightning=True)
    assert reports[1] is None  # the report is the launching process's
    got, explanation, losses, text = reports[0]
    assert got == verdict, (kind, M, explanation)
    assert all(len(v) == STEPS for v in losses.values()), losses
    assert "verdict: " + verdict in text and "pipelined − plain" in text, text
    assert ("one stage" in losses) == (M > 1)
    if verdict == "same run":  # step by step, the plain run's losses
        assert max(abs(a - b) for a, b in zip(losses["pipelined"], losses["plain"])) <= 1e-12, losses
    if verdict == "by design":
        assert "BatchNorm (backbone.3)" in explanation, explanation
    if verdict == "different":  # the parameters around the layer that depends on its process, named
        assert "backbone.5.weight" in explanation and "backbone.2.weight" in explanation, explanation
