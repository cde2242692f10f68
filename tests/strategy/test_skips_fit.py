"""GPipeStrategy on the guide's U-Net with declared long skips: the plain run's weights, at K = 3 and at pp 2 × dp 2
under NCCL's point-to-point ordering (the skip groups of every replica made alike on every rank)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_gpipe.pipe.comm.nccl_order import ENV
from tests.helpers.guide_unet import guide_unet
from tests.helpers.launch import quiet_trainer, run_distributed

N_SAMPLES, BATCH, STEPS, LR = 48, 6, 3, 0.05  # every replica has STEPS batches in its first epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(N_SAMPLES, 3, 8, 8, generator=g, dtype=torch.float64),
        torch.randn(N_SAMPLES, 3, 8, 8, generator=g, dtype=torch.float64),
    )


class UNetModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = guide_unet()().double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipeline_loss(self.backbone(batch[0]), batch)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(output, batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


def reference(dp: int) -> dict[str, torch.Tensor]:
    """Plain torch: each step averages the dp replicas' batches (the shards Lightning's DistributedSampler gives)."""
    net = UNetModule().backbone
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    shards = [torch.tensor(list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0))) for d in range(dp)]
    for step in range(STEPS):
        opt.zero_grad()
        for shard in shards:
            idx = shard[step * BATCH : (step + 1) * BATCH]
            (F.mse_loss(net(x_all[idx]), y_all[idx]) / dp).backward()
        opt.step()
    return {f"backbone.{k}": v.detach().clone() for k, v in net.named_parameters()}


def fit_worker(
    rank: int, world_size: int, pp: int, balance: list[int] | None, data_parallel: str = "ddp"
) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = UNetModule()
    strategy = GPipeStrategy(
        chunks=3, pipeline_parallel_size=pp, balance=balance or "parameters", data_parallel=data_parallel
    )
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS, precision="64-true")
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(world_size // pp)
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.named_parameters()}
    errors = {
        name: ((p.detach() - expected[name]).abs().max() / expected[name].abs().max()).item()
        for name, p in params.items()
    }
    sharded = sum(isinstance(p, DTensor) for p in module.parameters())
    return {
        "max": max(errors.values()),
        "checked": len(errors),
        "ranges": list(strategy.stage.layer_range),
        "sharded": sharded,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "pp", "balance", "nccl_order", "data_parallel"),
    [(3, 3, [6, 2, 6], False, "ddp"), (4, 2, None, True, "ddp"), (4, 2, None, False, "fsdp")],
)
def test_unet_fit_is_the_plain_run(
    world_size: int,
    pp: int,
    balance: list[int] | None,
    nccl_order: bool,
    data_parallel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """K = 3; pp = 2 × dp = 2 (in the NCCL layout); pp = 2 × dp = 2 with each replica holding a shard of its stage."""
    if nccl_order:
        monkeypatch.setenv(ENV, "1")
    results = run_distributed(fit_worker, world_size, pp, balance, data_parallel, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["max"] <= 1e-9 and r["checked"] >= 2, (rank, r)
        assert (r["sharded"] > 0) == (data_parallel == "fsdp"), (rank, r)
    assert sorted({i for r in results for i in r["ranges"]}) == list(range(14))


def test_the_partition_table_shows_where_the_skips_go() -> None:
    from lightning_gpipe.strategy._balance import Plan
    from lightning_gpipe.strategy._partition_report import PartitionReport, WholeModel

    backbone = guide_unet()()
    whole = WholeModel.read(backbone, "0", backbone)
    columns = dict(PartitionReport(whole, Plan([6, 2, 6], "explicit"), [6, 2, 6], None).table())
    assert columns["Long skips"] == ["full, half → 2", "", "full, half ← 0"]
    columns = dict(PartitionReport(whole, Plan([2, 3, 9], "explicit"), [2, 3, 9], None).table())
    assert columns["Long skips"] == ["full → 2", "half → 2", "full ← 0; half ← 1"]
    assert "Long skips" not in dict(PartitionReport(whole, Plan([14], "explicit"), [14], None).table())
