"""Validation with the loss inside: an output given straight to pipeline_loss never leaves the last stage."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch.utils.data import DataLoader
from torchmetrics import MeanAbsoluteError

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyHooked, dataset

KEYS = ("val_loss", "val_mae", "inner_l1")


class Evaluated(TinyHooked):
    """``use``: where validation_step uses the output besides pipeline_loss ("none", "before", "after", "return")."""

    def __init__(self, use: str = "none") -> None:
        super().__init__()
        self.use = use
        self.val_mae = MeanAbsoluteError()

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        pred = self.head(output)
        if not self.training:
            self.val_mae(pred, batch[1])
            self.log("val_mae", self.val_mae)
            self.log("inner_l1", F.l1_loss(pred, batch[1]))
        return F.mse_loss(pred, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = self.backbone(self.prefix(batch[0]))
        if self.use == "before":
            self.log("val_mean", out.mean() + 0.0)
        loss = self.pipeline_loss(out, batch)
        self.log("val_loss", loss)
        if self.use == "after":
            self.log("val_mean", torch.mean(out))
        return {"out": out} if self.use == "return" else None


class Late(Callback):
    """Touches a returned output after its step: what a callback drawing predictions would do."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        if outputs is not None:
            try:
                outputs["out"].sum()
            except RuntimeError as e:
                self.errors.append(str(e))


def validate(module: Evaluated, devices: int, strategy: Any, late: Late | None = None) -> dict[str, float]:
    trainer = quiet_trainer(devices=devices, strategy=strategy, callbacks=[late] if late else [])
    trainer.validate(module, DataLoader(dataset(), batch_size=BATCH))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def worker(rank: int, world_size: int, use: str) -> dict:
    import lightning_gpipe.pipe.run.loss_outside as schedule
    from lightning_gpipe.strategy import GPipeStrategy

    shared: list[str] = []
    real_share = schedule.share_output

    def counting(output: Any, mode: str, *args: Any) -> Any:
        shared.append(mode)
        return real_share(output, mode, *args)

    schedule.share_output = counting  # type: ignore[assignment]
    late = Late()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = validate(Evaluated(use), world_size, GPipeStrategy(chunks=3), late)
    second = [str(w.message) for w in caught if "ran a second time" in str(w.message)]
    return {"metrics": metrics, "shared": shared, "second": second, "late": late.errors}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use", ["none", "before", "after", "return"])
def test_validation_loss_runs_on_the_last_stage(use: str) -> None:
    """Logged values and metrics equal the plain run's on every stage; the output is shared with the other stages
    only where validation_step uses it besides pipeline_loss ("after": the pipeline runs again, with a warning;
    "return": touched after the step, a clear error instead of a pipeline run on the callback's ranks only)."""
    results = run_distributed(worker, 2, use, timeout=100, lightning=True)
    warnings.simplefilter("ignore")
    plain = validate(Evaluated(use), 1, "auto")
    batches = -(-len(dataset()) // BATCH)
    for rank, r in enumerate(results):
        for key in (*KEYS, *(("val_mean",) if use in ("before", "after") else ())):
            got, want = r["metrics"][key], plain[key]
            assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (rank, key, got, want)
        shipped = r["shared"].count("all")
        assert shipped == (batches if use in ("before", "after") else 0), (rank, r["shared"])
        assert r["shared"].count("last") == (0 if use == "before" else batches), (rank, r["shared"])
        assert bool(r["second"]) == (use == "after" and rank == 0), (rank, r["second"])
        assert len(r["late"]) == (batches if use == "return" else 0), (rank, r["late"])
        assert all("exists on the last stage only" in e for e in r["late"]), r["late"]
