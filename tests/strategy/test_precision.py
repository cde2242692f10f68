"""Mixed precision under GPipeStrategy: one loss-scaling decision for all stages; bf16 activations cross stages."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.devices import ACCELERATOR
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

INF_STEP = 2


class InfOnStep(torch.autograd.Function):
    """Identity whose backward returns inf at one step: an overflow on stage 0 only."""

    step = -1

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return torch.full_like(g, float("inf")) if InfOnStep.step == INF_STEP else g


class Poison(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InfOnStep.apply(x)


def fp16_worker(rank: int, world_size: int, hooked: bool, data_parallel: str = "ddp") -> dict[str, object]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module(hooked=hooked)
    module.backbone[1] = nn.Sequential(module.backbone[1], Poison())  # layer 1 lives on stage 0
    scales, changed = [], []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            InfOnStep.step = trainer.global_step
            self.before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            scales.append(float(trainer.precision_plugin.scaler.get_scale()))
            changed.append(any(not torch.equal(a, p) for a, p in zip(self.before, pl_module.parameters())))

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2, data_parallel=data_parallel),
        plugins=[MixedPrecision("16-mixed", ACCELERATOR)],
        max_steps=4,
        callbacks=[Watch()],
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    # A ShardedGradScaler agrees on found_inf over the world: every stage skips a step that overflowed on one.
    sharded = isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)
    return {"scales": scales, "changed": changed, "sharded_scaler": sharded}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("hooked", "data_parallel"),
    [(False, "ddp"), (True, "ddp"), (True, "fsdp")],
    ids=["loss between the phases", "loss inside the pipeline", "loss inside, sharded layers"],
)
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(hooked: bool, data_parallel: str) -> None:
    """GradScaler's unscale and inf check also over sharded gradients (FSDP's DTensors, dp = 1 here)."""
    results = run_distributed(fp16_worker, 2, hooked, data_parallel, timeout=180, lightning=True)
    for r in results:
        assert r["sharded_scaler"], r
        assert r["changed"][INF_STEP] is False, r  # skipped, also on stage 1 whose own gradients were finite
        assert all(r["changed"][s] for s in range(len(r["changed"])) if s != INF_STEP), r
        assert r["scales"][INF_STEP] == r["scales"][INF_STEP - 1] / 2, r  # one back-off
    assert results[0]["scales"] == results[1]["scales"]


def bf16_worker(rank: int, world_size: int) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module()
    seen: list[torch.dtype] = []
    first_layer_of_stage_1 = module.backbone[4]  # balance "parameters" splits the 8 layers 4 + 4
    first_layer_of_stage_1.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2),
        precision="bf16-mixed",
        max_steps=3,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    loss = float(trainer.callback_metrics["train_loss"])
    return {"dtypes": sorted({str(d) for d in seen}), "loss": loss, "stage": trainer.strategy.stage.index}


@pytest.mark.timeout(200)
def test_bf16_mixed_runs_and_sends_bf16_activations() -> None:
    results = run_distributed(bf16_worker, 2, timeout=180, lightning=True)
    stage1 = next(r for r in results if r["stage"] == 1)
    assert stage1["dtypes"] == ["torch.bfloat16"], stage1  # the activation crossed in the compute dtype
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in results)
    assert results[0]["loss"] == results[1]["loss"]


def bf16_true_worker(rank: int, world_size: int) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy
    from tests.helpers.tiny_fit import reference

    warnings.simplefilter("ignore")
    module = lightning_module()
    seen: list[torch.dtype] = []
    module.backbone[4].register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))  # stage 1's first layer
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, pipeline_parallel_size=2),
        precision="bf16-true",
        max_steps=4,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(1, None)  # fp32, same data and steps
    errors = {
        n: ((p.float().cpu() - expected[n]).abs().max() / expected[n].abs().max()).item()
        for n, p in module.named_parameters()
    }
    return {
        "dtypes": sorted({str(d) for d in seen}),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "max_error": max(errors.values()),
        "loss": float(trainer.callback_metrics["train_loss"]),
        "stage": trainer.strategy.stage.index,
    }


@pytest.mark.timeout(200)
def test_bf16_true_trains_in_bf16_like_the_fp32_run() -> None:
    results = run_distributed(bf16_true_worker, 2, timeout=180, lightning=True)
    for r in results:
        assert r["param_dtypes"] == ["torch.bfloat16"], r
        # bf16 keeps 8 bits of mantissa: after 4 SGD steps the weights are the fp32 run's to within a few ulps.
        assert r["max_error"] < 3e-2, r
    stage1 = next(r for r in results if r["stage"] == 1)
    assert stage1["dtypes"] == ["torch.bfloat16"], stage1
    assert results[0]["loss"] == results[1]["loss"]
