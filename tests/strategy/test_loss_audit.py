"""A loss that uses the backbone's parameters directly (an L2 penalty over self.parameters()) stops with one error."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpipe.strategy._audit import direct_uses
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module


def _parts() -> tuple[nn.Sequential, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    stage, head = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), nn.Linear(4, 1)
    output = stage(torch.randn(3, 4)).detach().requires_grad_()  # as the stage hands it over: no history
    return stage, head, output


def test_a_loss_through_the_output_uses_no_layer_directly() -> None:
    stage, head, output = _parts()
    assert direct_uses(head(output).square().mean(), stage, []) == []


def test_a_penalty_over_the_parameters_names_every_layer_it_uses() -> None:
    stage, head, output = _parts()
    penalty = sum(p.square().sum() for p in [*stage.parameters(), *head.parameters()])
    assert direct_uses(head(output).mean() + 1e-4 * penalty, stage, []) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # A functional use of one layer's weight outside the backbone is a direct use too.
    assert direct_uses(F.linear(output, stage[2].weight).sum(), stage, []) == ["2.weight"]


def test_a_weight_shared_with_a_module_outside_is_not_a_direct_use() -> None:
    stage, _, output = _parts()
    loss = F.linear(output, stage[2].weight).sum()  # as a tied embedding before the backbone would use it
    assert direct_uses(loss, stage, [stage[2].weight]) == []


def _penalized_step(self, batch, batch_idx):
    x, y = batch
    loss = F.mse_loss(self.head(self.backbone(self.prefix(x))), y)
    return loss + 1e-4 * sum(p.square().sum() for p in self.parameters())


def penalty_worker(rank: int, world_size: int) -> str:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module()
    module.training_step = _penalized_step.__get__(module)
    trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=2), max_steps=2)
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_penalty_over_self_parameters_fails_clearly_on_every_rank() -> None:
    for rank, message in enumerate(run_distributed(penalty_worker, 2, timeout=100, lightning=True)):
        assert "uses parameters of self.backbone directly" in message, (rank, message)
        assert "weight_decay" in message, (rank, message)
