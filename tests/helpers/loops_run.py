"""The pipelined side of test_loops: every scenario as a Lightning run under GPipeStrategy, launched once per size."""

from __future__ import annotations

import shutil
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.loops_reference import (
    CHUNKS,
    PP,
    Case,
    eval_dataset,
    make_net,
    reference,
    reference_evaluation,
    rel_err,
)
from tests.helpers.tiny_fit import BATCH, LR, dataset

WORLD2_CASES = (
    Case("accumulate", accumulate=2),
    # The epoch ends inside a window: Lightning steps after the fifth batch alone (its loss still / 2).
    Case("accumulate_uneven", accumulate=2, batches=5),
    Case("accumulate_clip_norm", accumulate=2, clip=0.05),
    Case("clip_value", clip=0.01, clip_algorithm="value"),
    Case("scheduler", scheduler=True),
    Case("manual", manual="plain"),
    Case("manual_accumulate", manual="accumulate", accumulate=2),
    Case("manual_clip_norm", manual="plain", clip=0.05),  # self.clip_gradients(...) before opt.step()
    # Micro-batches of 4: with 2, BatchNorm1d outputs ±1 whatever its input and passes back (almost) no gradient.
    Case("batchnorm", bn=True, batch=12, batches=4, evaluate=True),  # evaluation with the running statistics
    # Validation after the third batch falls inside an accumulation window; the one at the epoch's end sees the
    # final weights.
    Case("evaluate", accumulate=2, evaluate=True, val_check_interval=3),
    Case("checkpoint_top_k", checkpoint=True),
)
# 24 samples per replica: 4 batches, 2 optimizer steps; the DistributedSampler gives each replica different data.
WORLD4_CASES = (
    Case("dp_accumulate_clip_norm", batches=4, accumulate=2, clip=0.05, evaluate=True),
    Case("sync_batchnorm", bn=True, sync_bn=True, batch=12, batches=2, evaluate=True),
    # The replicas each hold a shard of their stage: the same runs.
    Case("fsdp_accumulate_clip_norm", batches=4, accumulate=2, clip=0.05, evaluate=True, data_parallel="fsdp"),
    Case("fsdp_manual_accumulate", batches=4, manual="accumulate", accumulate=2, data_parallel="fsdp"),
    Case("fsdp_sync_batchnorm", bn=True, sync_bn=True, batch=12, batches=2, evaluate=True, data_parallel="fsdp"),
    # Validation after each batch: inside each window the layers are resharded with their gradients still whole.
    Case("fsdp_evaluate", batches=4, accumulate=2, evaluate=True, val_check_interval=1, data_parallel="fsdp"),
)


class Writer(BasePredictionWriter):
    """Keeps what it is asked to write, batch by batch."""

    def __init__(self, written: list[torch.Tensor]) -> None:
        super().__init__("batch")
        self.written = written

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append(prediction)


# -------------------------------------------------------------------------------------------- the pipelined run
def loops_module(case: Case):
    import lightning.pytorch as pl
    from torchmetrics.regression import MeanSquaredError

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            net = make_net(case.bn)  # the same names and initial weights as the reference
            self.prefix, self.backbone, self.head = net.prefix, net.backbone, net.head
            self.automatic_optimization = case.manual is None
            # Torchmetrics syncs over the world group, where each pipeline's stages hold the same state twice: a
            # mean (sum of squares / count) is unchanged by that.
            self.val_mse = MeanSquaredError()
            self.test_mse = MeanSquaredError()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(self.prefix(x)))

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss)
            self.log("train_loss_sync", loss, sync_dist=True)
            # A sum shows over which group sync_dist reduces: the world (4 ranks) would double it at pp=2 × dp=2.
            self.log("train_loss_sum", loss, sync_dist=True, reduce_fx="sum")
            self.log("epoch_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if case.manual is None:
                return self._loss(batch)
            opt = self.optimizers()
            if case.manual == "plain":
                opt.zero_grad()
                loss = self._loss(batch)
                self.manual_backward(loss)
                if case.clip:
                    self.clip_gradients(opt, gradient_clip_val=case.clip, gradient_clip_algorithm="norm")
                opt.step()
                return loss
            step = (batch_idx + 1) % case.accumulate == 0
            with opt.toggle_model(sync_grad=step):  # no gradient reduction on the window's first batch
                loss = self._loss(batch)
                self.manual_backward(loss / case.accumulate)
            if step:
                opt.step()
                opt.zero_grad()
            return loss

        def _evaluate(self, batch: Any, prefix: str, metric: Any) -> None:
            x, y = batch
            out = self(x)
            self.log(f"{prefix}_loss", F.mse_loss(out, y), sync_dist=True)
            metric.update(out, y)
            self.log(f"{prefix}_mse", metric)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._evaluate(batch, "val", self.val_mse)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self._evaluate(batch, "test", self.test_mse)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LR)
            if not case.scheduler:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def run_case(case: Case, world_size: int, workdir: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpipe.strategy import GPipeStrategy

    module = loops_module(case)
    automatic = case.manual is None
    checkpoint = ModelCheckpoint(
        dirpath=f"{workdir}/{case.name}", monitor="train_loss", mode="min", save_top_k=1, every_n_train_steps=1
    )
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=CHUNKS, pipeline_parallel_size=PP, data_parallel=case.data_parallel),
        sync_batchnorm=case.sync_bn,
        max_epochs=1,
        limit_train_batches=case.batches,
        accumulate_grad_batches=case.accumulate if automatic else 1,
        gradient_clip_val=case.clip if automatic else None,
        gradient_clip_algorithm=case.clip_algorithm if case.clip and automatic else None,
        val_check_interval=case.val_check_interval,
        callbacks=[checkpoint] if case.checkpoint else None,
        enable_checkpointing=case.checkpoint,
    )
    val_loader = DataLoader(eval_dataset(), batch_size=BATCH) if case.evaluate else None
    trainer.fit(module, DataLoader(dataset(), batch_size=case.batch), val_loader)
    mesh = trainer.strategy.device_mesh
    result: dict[str, Any] = {
        "dp_rank": mesh["data_parallel"].get_local_rank(),
        "pp_rank": mesh["pipeline_parallel"].get_local_rank(),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }
    ref = reference(case, world_size // PP)
    # This stage's layers, under their global names, and the replicated prefix and head.
    errors = {name: rel_err(p, ref["params"][name]) for name, p in module.named_parameters()}
    buffers = {name: b for name, b in module.named_buffers() if name in ref["buffers"]}
    result.update(
        errors=errors,
        max=max(errors.values()),
        checked=len(errors),
        buffer_errors={name: rel_err(b, ref["buffers"][name]) for name, b in buffers.items()},
        ref_losses=ref["losses"],
        ref_lr=ref["lr"],
        clipped=ref["clipped"],
    )
    if case.evaluate:
        ref_eval = reference_evaluation(ref["net"])
        loader = DataLoader(eval_dataset(), batch_size=BATCH)
        validated = trainer.validate(module, loader, verbose=False)
        tested = trainer.test(module, loader, verbose=False)
        written: list[torch.Tensor] = []
        writer = Writer(written)
        trainer.callbacks.append(writer)
        predicted = trainer.predict(module, loader)
        trainer.callbacks.remove(writer)
        # Returned and written by stage 0 of each replica only; the other stages get None and write nothing.
        result.update(predict_none=predicted is None, written_batches=len(written))
        preds = torch.cat(written) if written else torch.empty(0)
        if predicted is not None:
            assert torch.equal(torch.cat(predicted), preds)
        # Predict shards over the replicas without padding: replica d gets samples d, d + dp, ...
        dp, d = world_size // PP, result["dp_rank"]
        want = ref_eval["predictions"][d::dp]
        result.update(
            ref_mse=ref_eval["mse"],
            validated=[{k: float(v) for k, v in out.items()} for out in validated],
            tested=[{k: float(v) for k, v in out.items()} for out in tested],
            predict_batches=len(written),
            predict_rows=len(preds),
            predict_err=rel_err(preds, want) if preds.shape == want.shape else float("inf"),
        )
    if case.checkpoint:
        result.update(
            best_score=float(checkpoint.best_model_score),
            best_path=Path(checkpoint.best_model_path).name,
            # What ModelCheckpoint and EarlyStopping ask the strategy: all(True) and any(only global rank 0).
            all_true=trainer.strategy.reduce_boolean_decision(True),
            any_rank0=trainer.strategy.reduce_boolean_decision(trainer.global_rank == 0, all=False),
        )
    return result


def loops_worker(rank: int, world_size: int, cases: tuple[Case, ...], workdir: str) -> dict[str, dict[str, Any]]:
    warnings.simplefilter("ignore")  # the last evaluation batch (2 < CHUNKS) warns by design
    results = {}
    for case in cases:
        try:
            results[case.name] = run_case(case, world_size, workdir)
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
    return results


_LAUNCHES: dict[int, Any] = {}


def launch(world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Every scenario of one world size in one launch, run once per pytest session."""
    if world_size not in _LAUNCHES:
        cases = WORLD2_CASES if world_size == 2 else WORLD4_CASES
        workdir = tempfile.mkdtemp(prefix="gpipe-loops-")
        try:
            _LAUNCHES[world_size] = run_distributed(
                loops_worker, world_size, cases, workdir, timeout=240, lightning=True
            )
        except Exception as e:  # don't relaunch (and wait again) for every test that reads it
            _LAUNCHES[world_size] = e
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    got = _LAUNCHES[world_size]
    if isinstance(got, Exception):
        raise got
    return got


def case_results(world_size: int, name: str) -> list[dict[str, Any]]:
    per_rank = [r[name] for r in launch(world_size)]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, "\n".join(errors)
    return per_rank
