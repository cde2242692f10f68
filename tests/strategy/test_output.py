"""output="placeholder": only the last stage holds the backbone's output; losses, logs and metrics are the same run."""

from __future__ import annotations

import warnings

import pytest
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, STEPS, TinyPipelined, dataset, reference

TOL = 1e-6


class Logged(TinyPipelined):
    """Logs on step and epoch, updates torchmetrics objects, validates: everything that reads the output."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_mae = torchmetrics.MeanAbsoluteError()
        self.val_mse = torchmetrics.MeanSquaredError()
        self.zero_outputs: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.backbone(self.prefix(x)))
        self.zero_outputs.append(bool((out == self.head.bias).all()))  # head(zeros) == bias: a placeholder
        loss = F.mse_loss(out, y)
        self.train_mae(out, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_mae", self.train_mae, on_step=True, on_epoch=True)
        return {"loss": loss, "first": out[0, 0].detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("first_output", outputs["first"])  # the step's returned values too

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.backbone(self.prefix(x)))
        self.val_mse.update(out, y)
        self.log("val_loss", F.mse_loss(out, y))

    def on_validation_epoch_end(self):
        self.log("val_mse", self.val_mse.compute())
        self.val_mse.reset()


def worker(rank: int, world_size: int) -> dict:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    runs = {}
    for output in ("all", "placeholder"):
        module = Logged()
        trainer = quiet_trainer(
            devices=world_size,
            strategy=GPipeStrategy(chunks=3, output=output),
            max_steps=STEPS,
            limit_val_batches=2,
            val_check_interval=2,
        )
        loader = DataLoader(dataset(), batch_size=BATCH)
        trainer.fit(module, loader, loader)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        expected = reference(1, None)
        errors = {
            n: ((p.detach().cpu() - expected[n]).abs().max() / expected[n].abs().max()).item()
            for n, p in module.named_parameters()
        }
        runs[output] = {"metrics": metrics, "max_error": max(errors.values()), "zeros": module.zero_outputs}
    return runs


@pytest.mark.timeout(200)
def test_loss_only_output_is_the_same_run() -> None:
    results = run_distributed(worker, 2, timeout=180, lightning=True)
    for rank, runs in enumerate(results):
        for output, run in runs.items():
            assert run["max_error"] <= TOL, (rank, output, run)
        assert runs["placeholder"]["metrics"].keys() == runs["all"]["metrics"].keys()
        assert {"train_loss_step", "train_mae_epoch", "val_loss", "val_mse", "first_output"} <= runs["placeholder"][
            "metrics"
        ].keys()
        for key, value in runs["all"]["metrics"].items():
            assert abs(runs["placeholder"]["metrics"][key] - value) <= TOL * max(1.0, abs(value)), (rank, key)
    # No output data crossed: stage 0 computed on zeros in every step; with output="all" it never did.
    assert results[0]["placeholder"]["zeros"] == [True] * STEPS and not any(results[0]["all"]["zeros"])
    assert not any(results[1]["placeholder"]["zeros"])
