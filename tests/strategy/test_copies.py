"""Weights with copies on several ranks: tied across stages inside the backbone, and replicas of an unseeded model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import models
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, LR, dataset

TOL = 1e-6
STEPS = 4


def tied_backbone() -> nn.Sequential:
    """The first and the last layer share one weight, as a tied embedding and output projection do in NMT."""
    torch.manual_seed(4321)
    first, last = nn.Linear(models.D, models.D), nn.Linear(models.D, models.D)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), *models.mlp(4), nn.Tanh(), last)


def reference(clip: float) -> dict[str, torch.Tensor]:
    from torch.utils.data import DistributedSampler

    net = tied_backbone()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    idx_all = torch.tensor(list(DistributedSampler(dataset(), num_replicas=1, rank=0, seed=0)))
    for step in range(STEPS):
        opt.zero_grad()
        idx = idx_all[step * BATCH : (step + 1) * BATCH]
        F.mse_loss(net(x_all[idx]), y_all[idx]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return {f"backbone.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def tied_worker(rank: int, world_size: int, clip: float) -> dict:
    import lightning.pytorch as pl

    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")

    class Tied(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = tied_backbone()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.backbone(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Tied()
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, balance=[3, 2, 3]),
        max_steps=STEPS,
        gradient_clip_val=clip,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(clip)
    errors = {
        k: ((v.cpu() - expected[k]).abs().max() / expected[k].abs().max()).item()
        for k, v in module.state_dict().items()
    }
    return {"errors": errors, "shared": [(n, s) for n, s, _ in trainer.strategy.stage.shared]}


@pytest.mark.timeout(200)
def test_weight_tied_across_first_and_last_stage_trains_as_one_weight() -> None:
    """K = 3: stage 0 and stage 2 hold the tied weight, stage 1 does not; global-norm clipping counts it once."""
    results = run_distributed(tied_worker, 3, 0.05, timeout=180, lightning=True)
    for rank, r in enumerate(results):
        assert r["shared"] == [("0.weight", (0, 2))], r
        assert r["errors"] and max(r["errors"].values()) <= TOL, (rank, r["errors"])
    assert "backbone.0.weight" in results[0]["errors"] and "backbone.7.weight" in results[2]["errors"]
    assert not any("weight" in k and k.startswith(("backbone.0.", "backbone.7.")) for k in results[1]["errors"])


def unseeded_worker(rank: int, world_size: int) -> dict:
    from lightning_gpipe import GPipeStrategy
    from tests.helpers.tiny_fit import TinyPipelined

    warnings.simplefilter("ignore")
    module = TinyPipelined(lr=0.0)
    torch.manual_seed(100 + rank)  # as if nobody seeded: every rank starts from different weights
    for p in module.parameters():
        p.data.normal_()
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2),
        max_steps=1,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return {k: v.tolist() for k, v in module.state_dict().items()}  # plain lists: tensors die with the process


@pytest.mark.timeout(200)
def test_replicas_and_replicated_layers_start_from_rank_0s_weights() -> None:
    """pp = 2 × dp = 2, every rank initialized differently: replicas equal, prefix/head equal on both stages."""
    states = run_distributed(unseeded_worker, 4, timeout=180, lightning=True)
    for k in (0, 1):  # replica 1's stage k equals replica 0's stage k (lr = 0: the step changes nothing)
        assert states[k].keys() == states[2 + k].keys()
        for name in states[k]:
            assert states[k][name] == states[2 + k][name], (k, name)
    for name in ("prefix.weight", "head.weight", "head.bias"):
        assert all(s[name] == states[0][name] for s in states), name
    # Rank 0's own initial draw survived: its prefix is N(0, 1) from seed 100, not anyone else's.
    from tests.helpers.tiny_fit import TinyPipelined

    first = TinyPipelined(lr=0.0)
    torch.manual_seed(100)
    for p in first.parameters():
        p.data.normal_()
    assert states[0]["prefix.weight"] == first.prefix.weight.tolist()
