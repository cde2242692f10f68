"""Backbones the pipeline cannot run as written are refused at setup on every rank: an nn.Sequential with its own
forward, weights or hooks, and nn.SyncBatchNorm; nn.Sequential subclasses that only build their layers still run."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.pipe import GPipeStage
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.models import D
from tests.helpers.tiny_fit import BATCH, dataset


class Doubled(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class Scaled(nn.Sequential):
    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.scale = nn.Parameter(torch.full((1,), 2.0))
        self.register_buffer("offset", torch.zeros(1))


def _layers() -> list[nn.Module]:
    return [nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)]


def test_a_sequential_that_adds_to_its_layers_is_refused_by_the_engine() -> None:
    # Before: each built a stage that silently dropped the addition (outputs 0.7 and 2.0 off, `scale` not saved).
    with pytest.raises(TypeError, match=r"GPipeStage\(module\) is a Doubled .* its own forward \(Doubled.forward\)"):
        GPipeStage(Doubled(*_layers()))
    with pytest.raises(TypeError, match=r"parameters set on it directly \(scale\); buffers .* \(offset\)") as info:
        GPipeStage(Scaled(*_layers()))
    assert "a `Scale` module appended to the layers" in str(info.value)
    hooked = nn.Sequential(*_layers())  # a plain nn.Sequential's own hooks would be dropped as well
    hooked.register_forward_hook(lambda m, i, o: o * 3)
    hooked.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(TypeError, match=r"hooks registered on it \(1 forward pre-hooks, 1 forward hooks\)") as info:
        GPipeStage(hooked)
    assert "a forward pre-hook goes on the first layer, a forward hook on the last" in str(info.value)


def test_library_sequentials_that_only_build_their_layers_still_run() -> None:
    import torchvision
    from timm.models.levit import Stem16

    torch.manual_seed(0)
    for backbone, x in (
        (Stem16(3, 16, nn.Hardswish), torch.randn(4, 3, 16, 16)),  # timm: a Sequential of its ConvNorm layers
        (torchvision.models.densenet._Transition(4, 4), torch.randn(4, 4, 4, 4)),
        (torchvision.models.regnet_x_400mf().trunk_output.block2, torch.randn(2, 32, 8, 8)),  # an AnyStage
    ):
        backbone.eval()
        with torch.no_grad():
            want = backbone(x)
            got = GPipeStage(backbone, chunks=2)(x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


class Module(pl.LightningModule):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.backbone(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(backbone: nn.Module, data: TensorDataset, data_parallel: str = "ddp", **trainer: Any) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=2, data_parallel=data_parallel)
    fit = quiet_trainer(devices=2, strategy=strategy, max_steps=1, **trainer)
    try:
        fit.fit(Module(backbone), DataLoader(data, batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals_worker(rank: int, world_size: int) -> dict[str, str]:
    import torchvision

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    images = TensorDataset(torch.randn(12, 4, 4, 4), torch.randn(12, 4, 2, 2))
    out = {"doubled": _fit(Doubled(*_layers()), dataset())}
    # The way out the SyncBatchNorm error gives: plain BatchNorm, synced by the strategy.
    synced = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, D))
    out["synced"] = _fit(synced, dataset(), sync_batchnorm=True)
    out["transition"] = _fit(torchvision.models.densenet._Transition(4, 4), images)
    from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging

    averaged = [EMAWeightAveraging(decay=0.8)]
    out["averaged_fsdp"] = _fit(nn.Sequential(*_layers()), dataset(), "fsdp", callbacks=averaged)
    # Last: before, it failed inside a step, after which the processes were not reused.
    sync_bn = nn.Sequential(nn.Linear(D, D), nn.SyncBatchNorm(D), nn.Linear(D, D))
    out["sync_bn"] = _fit(sync_bn, dataset())
    return out


@pytest.mark.timeout(150)
def test_refusals_stop_every_rank_at_setup_and_plain_subclasses_fit() -> None:
    for r in run_distributed(refusals_worker, 2, timeout=130, lightning=True):
        # Before: "no error" (the fit trained without the * 2).
        assert r["doubled"].startswith("TypeError: GPipeStrategy(backbone='backbone'): self.backbone is a Doubled"), r
        # Before: every rank failed in its first step, inside torch: "SyncBatchNorm expected input tensor to be on GPU".
        assert r["sync_bn"].startswith("TypeError: GPipeStrategy: Module holds nn.SyncBatchNorm layers: backbone.1 "), r
        assert "pass Trainer(sync_batchnorm=True)" in r["sync_bn"], r
        assert r["synced"] == "no error", r
        assert r["transition"] == "no error", r
        # Before: the copy's whole layers met their shards inside torch ("got mixed torch.Tensor and DTensor").
        assert r["averaged_fsdp"].startswith("ValueError: GPipeStrategy(data_parallel='fsdp') cannot keep a weight"), r
        assert "Use data_parallel='ddp'" in r["averaged_fsdp"], r
