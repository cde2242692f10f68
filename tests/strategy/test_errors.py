"""Bad input to GPipeStrategy: one clear error on every rank, before any work — never a hang."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module


def _fit(module, sync_batchnorm: bool = False, **strategy_kwargs) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    trainer = quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(**{"chunks": 2, **strategy_kwargs}),
        max_steps=2,
        sync_batchnorm=sync_batchnorm,
    )
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _with_step(step: Callable) -> object:
    module = lightning_module()
    module.training_step = step.__get__(module)
    return module


def _twice(self, batch, batch_idx):
    x, y = batch
    h = self.backbone(self.prefix(x))
    return F.mse_loss(self.head(self.backbone(self.prefix(x)) + h), y)


def _never(self, batch, batch_idx):
    x, y = batch
    return F.mse_loss(self.head(self.prefix(x)), y)


def _lbfgs(module):
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.parameters())
    return module


def _not_sequential():
    module = lightning_module()
    module.backbone = nn.ModuleList(list(module.backbone))
    return module


def _bn_in_head():
    module = lightning_module()
    module.head = nn.Sequential(nn.BatchNorm1d(module.head.in_features), module.head)
    return module


def errors_worker(rank: int, world_size: int) -> dict[str, str]:
    warnings.simplefilter("ignore")
    out = {
        "missing": _fit(lightning_module(), backbone="trunk"),
        "not_sequential": _fit(_not_sequential()),
        "k_does_not_divide": _fit(lightning_module(), pipeline_parallel_size=3),
        "balance": _fit(lightning_module(), balance=[4, 5]),
        "lbfgs": _fit(_lbfgs(lightning_module())),
        "sync_not_deferred": _fit(lightning_module(), sync_batchnorm=True, deferred_batch_norm=False),
        "sync_outside": _fit(_bn_in_head(), sync_batchnorm=True),
    }
    # Last: these fail inside a step, after which the pipeline is not reused.
    out["never_called"] = _fit(_with_step(_never))
    return out


def twice_worker(rank: int, world_size: int) -> str:
    warnings.simplefilter("ignore")
    return _fit(_with_step(_twice))


@pytest.mark.timeout(200)
def test_bad_input_fails_clearly_on_every_rank() -> None:
    results = run_distributed(errors_worker, 2, timeout=180, lightning=True)
    assert results[0] == results[1] or all(r.keys() == results[0].keys() for r in results)
    for r in results:
        assert "no attribute 'trunk'" in r["missing"] and "'backbone'" in r["missing"], r["missing"]
        assert r["not_sequential"].startswith("TypeError") and "ModuleList" in r["not_sequential"]
        assert "pipeline_parallel_size=3" in r["k_does_not_divide"] and "world size 2" in r["k_does_not_divide"]
        assert "sums to 9" in r["balance"] and "8 layers" in r["balance"], r["balance"]
        assert "LBFGS" in r["lbfgs"] and "closure" in r["lbfgs"], r["lbfgs"]
        assert "did not call self.backbone" in r["never_called"], r["never_called"]
        assert "deferred_batch_norm=True" in r["sync_not_deferred"], r["sync_not_deferred"]
        assert "outside it: ['head.0']" in r["sync_outside"], r["sync_outside"]


@pytest.mark.timeout(120)
def test_backbone_called_twice() -> None:
    for message in run_distributed(twice_worker, 2, timeout=100, lightning=True):
        assert "PipelineError" in message and "self.backbone was called again" in message, message


def _rank_zero_only_validation(self, batch, batch_idx):
    x, y = batch
    out = self.backbone(self.prefix(x)) if self.global_rank == 0 else self.prefix(x)  # the bug under test
    self.log("val_loss", F.mse_loss(self.head(out), y))


def _rank_zero_only_training(self, batch, batch_idx):
    x, y = batch
    out = self.backbone(self.prefix(x)) if self.global_rank == 0 else self.prefix(x)
    return F.mse_loss(self.head(out), y)


def one_rank_worker(rank: int, world_size: int, where: str) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module()
    if where == "validation":
        module.validation_step = _rank_zero_only_validation.__get__(module)
    else:
        module.training_step = _rank_zero_only_training.__get__(module)
    trainer = quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(chunks=2, timeout=timedelta(seconds=5)),
        max_steps=2,
    )
    loader = DataLoader(dataset(), batch_size=BATCH)
    try:
        if where == "validation":
            trainer.validate(module, loader, verbose=False)
        else:
            trainer.fit(module, loader)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
def test_backbone_called_on_one_rank_only() -> None:
    """In training the other stage names the missing call; in evaluation stage 0 fails saying what probably happened."""
    for message in run_distributed(one_rank_worker, 2, "training", timeout=100, lightning=True):
        assert "did not call self.backbone" in message, message
    messages = run_distributed(one_rank_worker, 2, "validation", timeout=100, lightning=True)
    # Stage 1 ran its validation without the pipeline and ended; stage 0, waiting for the output, says why.
    assert "PipelineTimeout" in messages[0] and "never on one rank only" in messages[0], messages[0]
