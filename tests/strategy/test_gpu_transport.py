"""What GPUs ask of the transport, checked wherever the tests run: boundary tensors far larger than NCCL's buffers
finish under every schedule, and a stage's failure inside a kernel stops every rank within seconds.

In ``python -m tests.gpu_matrix`` they run over NCCL, one GPU per process, where the out-of-range index of the
second test is an asynchronous device-side assert. On the CPU the second runs over gloo with NCCL's point-to-point
rules modelled (``GPIPE_NCCL_SEMANTICS=1``, see ``pipe.comm.nccl_order``); the first only on GPUs, as sizes matter only
there (under the model every send waits for its receive, and ``test_nccl_order_fit.py`` runs the same orders).
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.pipe.comm.nccl_order import ENV
from tests.helpers.devices import on_cuda
from tests.helpers.launch import quiet_trainer, run_distributed

W = 2**20  # floats per sample: 4 MiB, so a micro-batch of 4 samples crosses as a 16 MiB tensor
N, M = 16, 4


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*(Scale() for _ in range(4)))

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.backbone(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WideInside(Wide):
    """The loss as ``pipeline_loss``: GPipeStrategy runs it per micro-batch on the last stage."""

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self.backbone(batch[0]), batch)
        self.log("train_loss", loss)
        return loss

    def pipeline_loss(self, out: torch.Tensor, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(out, batch[1])


def large_worker(rank: int, world_size: int, schedule: str | None) -> float:
    from lightning_gpipe.strategy import GPipeStrategy

    os.environ.setdefault(ENV, "0" if on_cuda() else "1")
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2 * N, W, generator=g), torch.randn(2 * N, W, generator=g))
    strategy = GPipeStrategy(chunks=M, schedule=schedule or "gpipe", timeout=timedelta(seconds=120))
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    trainer.fit(WideInside() if schedule else Wide(), DataLoader(data, batch_size=N))
    return float(trainer.callback_metrics["train_loss"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", [None, "gpipe", "1f1b", "zb-h1"])
def test_16_mib_boundaries_finish_under_every_schedule(schedule: str | None) -> None:
    """None: the loss outside the pipeline (whole output shared with stage 0, 64 MiB); else the loss inside."""
    if not on_cuda():  # NCCL's buffers are what make size matter; its ordering is modelled at any size
        pytest.skip(
            "over NCCL only (python -m tests.gpu_matrix): under GPIPE_NCCL_SEMANTICS every send waits for its "
            "receive whatever its size, and tests/strategy/test_nccl_order_fit.py runs these orders on the CPU"
        )
    losses = run_distributed(large_worker, 2, schedule, timeout=280, lightning=True)
    assert losses[0] == losses[1] and 0 < losses[0] < 10, losses


class Lookup(nn.Module):
    """An embedding lookup; at step 2 the ids handed to it are out of range (a device-side assert on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 4)
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0].abs() * 3).long() % 8 + (1000 if self.bad else 0)
        return x + self.table(ids).sum(-1, keepdim=True)


class Faulty(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Lookup(), nn.Linear(4, 4))

    def training_step(self, batch, batch_idx):
        for m in self.modules():  # on the stage that holds it
            if isinstance(m, Lookup):
                m.bad = batch_idx == 2
        return F.mse_loss(self.backbone(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def assert_worker(rank: int, world_size: int) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    os.environ.setdefault(ENV, "0" if on_cuda() else "1")
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 4, generator=g))
    strategy = GPipeStrategy(chunks=2, balance=[2, 2], timeout=timedelta(seconds=60))
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=5)
    start = time.monotonic()
    try:
        trainer.fit(Faulty(), DataLoader(data, batch_size=6))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - start}
    return {"error": None}


@pytest.mark.timeout(300)
def test_a_failing_kernel_on_stage_1_stops_every_rank_within_seconds() -> None:
    for rank, got in enumerate(run_distributed(assert_worker, 2, timeout=200, lightning=True)):
        assert got["error"] is not None and "stage 1" in str(got["error"]), (rank, got)
        assert got["after_s"] < 45, (rank, got)  # far below the 60 s timeout: told, not timed out
