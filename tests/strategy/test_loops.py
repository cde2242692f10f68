"""GPipeStrategy inside Lightning's loops: each feature gives the same run as plain torch doing the same computation.

Accumulation, clipping by norm and by value, manual optimization, LR schedulers, deferred BatchNorm, the
validate/test/predict loops and ``self.log`` (with ``sync_dist``) are each compared, parameter by parameter (≤ 1e-6
relative, fp32), with a plain single-process reference. Processes are few: one world-2 launch runs every pp=2
scenario as a sequence of ``Trainer`` runs (Lightning reuses the process group), one world-4 launch the pp=2 × dp=2
one; the tests below read the launches' cached results.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_gpipe.pipe import micro_batch_sizes
from tests.helpers import models
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, LR, Net, dataset

TOL = 1e-6
PP = 2
CHUNKS = 3
EVAL_SAMPLES = 20  # batches of 6, 6, 6, 2: the last one runs fewer micro-batches than CHUNKS
BN_LAYERS = (1, 4)  # models.with_bn(): Linear, BN, Tanh, Linear, BN, Tanh


@dataclass(frozen=True)
class Case:
    name: str
    batches: int = 6  # training batches (limit_train_batches, one epoch)
    batch: int = BATCH
    accumulate: int = 1  # accumulate_grad_batches, or the manual accumulation window
    clip: float | None = None
    clip_algorithm: str = "norm"
    scheduler: bool = False  # StepLR(step_size=1, gamma=0.5), stepped every optimizer step
    manual: str | None = None  # None (automatic), "plain" or "accumulate"
    bn: bool = False
    evaluate: bool = False  # a validation loader in fit, then validate, test and predict
    val_check_interval: int | None = None
    checkpoint: bool = False  # ModelCheckpoint(monitor="train_loss", save_top_k=1) every step
    sync_bn: bool = False  # Trainer(sync_batchnorm=True): micro-batch m normalized over all replicas' m-th ones


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
)


class BNNet(nn.Module):
    """Test_strategy's Net with BatchNorm in the backbone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.prefix = nn.Linear(models.D, models.D)
        self.backbone = models.with_bn()
        self.head = nn.Linear(models.D, models.D)
        # Not the default 1 and 0: a bias that starts at 0 and moves by 1e-3 would be compared at the ulp level.
        for i in BN_LAYERS:
            nn.init.uniform_(self.backbone[i].weight, 0.5, 1.5)
            nn.init.uniform_(self.backbone[i].bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(x)))


def make_net(bn: bool) -> nn.Module:
    return BNNet() if bn else Net()


def eval_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(EVAL_SAMPLES, models.D, generator=g), torch.randn(EVAL_SAMPLES, models.D, generator=g)
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ------------------------------------------------------------------------------------------------- the reference
def _per_micro_batch(net: nn.Module, x: torch.Tensor, full_bn: dict[int, nn.Module]) -> torch.Tensor:
    """What GPipe computes: each micro-batch through the plain model alone (BatchNorm with micro-batch statistics).

    ``full_bn`` (copies of the BatchNorm layers) sees each BatchNorm's whole mini-batch input at once: its running
    statistics are what deferred BatchNorm must end with.
    """
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in full_bn}
    hooks = [
        net.backbone[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0].detach()))
        for i, got in seen.items()
    ]
    try:
        out = torch.cat([net(mb) for mb in x.split(micro_batch_sizes(len(x), CHUNKS))])
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, bn in full_bn.items():
            bn(torch.cat(seen[i]))
    return out


def reference(case: Case, dp: int) -> dict[str, Any]:
    """Plain torch: per optimizer step, the mean over dp replicas × accumulation window of the batches' gradients."""
    net = make_net(case.bn)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.scheduler else None
    full_bn = {i: copy.deepcopy(net.backbone[i]) for i in BN_LAYERS} if case.bn else {}
    x_all, y_all = dataset().tensors
    # Lightning shuffles a training loader's injected DistributedSampler (seed 0, epoch 0).
    shards = [torch.tensor(list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0))) for d in range(dp)]
    losses: list[list[float]] = [[] for _ in range(dp)]
    clipped = False
    for b in range(case.batches):
        if b % case.accumulate == 0:
            opt.zero_grad()
        batches = [shard[b * case.batch : (b + 1) * case.batch] for shard in shards]
        outs = _synced_micro_batches(net, [x_all[i] for i in batches], full_bn) if case.sync_bn else None
        for d, idx in enumerate(batches):
            x, y = x_all[idx], y_all[idx]
            if outs is None:
                outs_d = _per_micro_batch(net, x, full_bn) if case.bn else net(x)
            out = outs[d] if outs is not None else outs_d
            loss = F.mse_loss(out, y)
            (loss / (dp * case.accumulate)).backward(retain_graph=outs is not None)
            losses[d].append(loss.item())
        if (b + 1) % case.accumulate and b != case.batches - 1:
            continue
        if case.clip and case.clip_algorithm == "norm":
            clipped |= bool(torch.nn.utils.clip_grad_norm_(net.parameters(), case.clip) > case.clip)
        elif case.clip:
            clipped |= max(p.grad.abs().max().item() for p in net.parameters()) > case.clip
            torch.nn.utils.clip_grad_value_(net.parameters(), case.clip)
        opt.step()
        if sched is not None:
            sched.step()
    for i, bn in full_bn.items():  # the plain model, evaluated, normalizes with the whole mini-batches' statistics
        for name, buffer in bn.named_buffers():  # (its weight and bias are the trained ones, not bn's)
            net.backbone[i].get_buffer(name).copy_(buffer)
    buffers = {f"backbone.{i}.{k}": v.clone() for i, bn in full_bn.items() for k, v in bn.named_buffers()}
    return {
        "net": net,
        "params": {k: v.detach().clone() for k, v in net.named_parameters()},
        "buffers": buffers,
        "losses": losses,
        "lr": opt.param_groups[0]["lr"],
        "clipped": clipped,
    }


class Writer(BasePredictionWriter):
    """Keeps what it is asked to write, batch by batch."""

    def __init__(self, written: list[torch.Tensor]) -> None:
        super().__init__("batch")
        self.written = written

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.written.append(prediction)


def reference_evaluation(net: nn.Module) -> dict[str, Any]:
    """The plain model on the evaluation set. The logged val_loss (a batch-size weighted mean of per-batch means, over
    the replicas' shards with sync_dist) and the MeanSquaredError both come to the MSE of the whole set."""
    net.eval()
    x_all, y_all = eval_dataset().tensors
    with torch.no_grad():
        out = net(x_all)
    return {"mse": F.mse_loss(out, y_all).item(), "predictions": out}


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


def _synced_micro_batches(net: nn.Module, xs: list[torch.Tensor], full_bn: dict[int, nn.Module]) -> list[torch.Tensor]:
    """What synchronized BatchNorm computes: micro-batch m of every replica through the plain model together (one
    set of statistics over all replicas' m-th micro-batches); ``full_bn`` sees the whole global mini-batch."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in full_bn}
    hooks = [
        net.backbone[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0].detach()))
        for i, got in seen.items()
    ]
    pieces = [x.split(micro_batch_sizes(len(x), CHUNKS)) for x in xs]
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    try:
        for m in range(len(pieces[0])):
            joint = net(torch.cat([p[m] for p in pieces]))
            for d, out in enumerate(joint.split([p[m].shape[0] for p in pieces])):
                outs[d].append(out)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, bn in full_bn.items():
            bn(torch.cat(seen[i]))
    return [torch.cat(o) for o in outs]


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
        strategy=GPipeStrategy(chunks=CHUNKS, pipeline_parallel_size=PP),
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


def check_training(world_size: int, name: str) -> list[dict[str, Any]]:
    """Weights equal the reference on every rank; the logged loss is the reference's loss of the last batch."""
    per_rank = case_results(world_size, name)
    for rank, r in enumerate(per_rank):
        assert r["max"] <= TOL, (name, rank, r["errors"])
        assert r["checked"] > 4, (name, rank, r["errors"])  # replicated prefix/head plus this stage's layers
        last = r["ref_losses"][r["dp_rank"]][-1]
        assert rel(r["metrics"]["train_loss"], last) <= TOL, (name, rank, r["metrics"], last)
    # Every parameter was compared on some stage of the pipeline.
    compared = set().union(*(r["errors"] for r in per_rank[:PP]))
    assert {n for n in compared if n.startswith("backbone.")} == {
        n for n, _ in make_net("batchnorm" in name).named_parameters() if n.startswith("backbone.")
    }
    return per_rank


# ---------------------------------------------------------------------------------------------------- the tests
T = 300  # the first test to read a launch pays for it (world 2 runs eleven Trainer.fit in sequence)


@pytest.mark.timeout(T)
@pytest.mark.parametrize("name", ["accumulate", "accumulate_uneven", "accumulate_clip_norm"])
def test_gradient_accumulation(name: str) -> None:
    """accumulate_grad_batches=2 (+ clipping by the global norm): two batches' gradients, each loss / 2, one step."""
    per_rank = check_training(2, name)
    if name == "accumulate_clip_norm":
        assert per_rank[0]["clipped"]  # the clip was active, so the comparison covers it


@pytest.mark.timeout(T)
def test_gradient_accumulation_with_data_parallel_replicas() -> None:
    """pp=2 × dp=2 with accumulation and clipping; every replica reads its own shard of the data."""
    per_rank = check_training(4, "dp_accumulate_clip_norm")
    assert per_rank[0]["clipped"]
    assert [r["dp_rank"] for r in per_rank] == [0, 0, 1, 1]
    assert [r["pp_rank"] for r in per_rank] == [0, 1, 0, 1]
    # Different data per replica (pytorch#60118: identical data hides a missing gradient reduction).
    assert per_rank[0]["metrics"]["train_loss"] != per_rank[2]["metrics"]["train_loss"]


@pytest.mark.timeout(T)
@pytest.mark.parametrize("name", ["manual", "manual_accumulate", "manual_clip_norm"])
def test_manual_optimization(name: str) -> None:
    """manual_backward + opt.step(); toggle_model(sync_grad=...) over a window of 2 batches; self.clip_gradients."""
    per_rank = check_training(2, name)
    if name == "manual_clip_norm":
        assert per_rank[0]["clipped"]


@pytest.mark.timeout(T)
def test_lr_scheduler_every_step() -> None:
    per_rank = check_training(2, "scheduler")
    for r in per_rank:
        assert r["lr"] == r["ref_lr"] == LR * 0.5**6, r


@pytest.mark.timeout(T)
def test_gradient_clipping_by_value() -> None:
    per_rank = check_training(2, "clip_value")
    assert per_rank[0]["clipped"]


def check_running_statistics(per_rank: list[dict[str, Any]]) -> None:
    """Every BatchNorm buffer equals the reference's on the stage holding it, and both BatchNorms were compared: the
    first one's input does not depend on earlier normalization, the second one's does."""
    found = {}
    for rank, r in enumerate(per_rank):
        assert all(e <= TOL for e in r["buffer_errors"].values()), (rank, r["buffer_errors"])
        found.update(r["buffer_errors"])
    stats = ("running_mean", "running_var", "num_batches_tracked")
    assert set(found) == {f"backbone.{i}.{k}" for i in BN_LAYERS for k in stats}


@pytest.mark.timeout(T)
def test_deferred_batchnorm_in_the_trainer() -> None:
    """Micro-batch normalization (weights equal a per-micro-batch plain run); running statistics equal nn.BatchNorm
    on the whole mini-batch, updated once per step. (Evaluation with them: test_validate_test_predict.)"""
    check_running_statistics(check_training(2, "batchnorm"))


@pytest.mark.timeout(T)
def test_sync_batchnorm_over_data_parallel_replicas() -> None:
    """pp = 2 × dp = 2, Trainer(sync_batchnorm=True): each micro-batch normalized with the statistics of all replicas'
    micro-batches (weights equal the plain run that normalizes them together); running statistics equal nn.BatchNorm
    on the whole global mini-batch, identical on the replicas."""
    check_running_statistics(check_training(4, "sync_batchnorm"))


@pytest.mark.timeout(T)
@pytest.mark.parametrize(
    ("world_size", "name"),
    [(2, "evaluate"), (2, "batchnorm"), (4, "dp_accumulate_clip_norm"), (4, "sync_batchnorm")],
)
def test_validate_test_predict(world_size: int, name: str) -> None:
    """After fit, the evaluation loops give the plain model's metrics and predictions, the same on every rank."""
    per_rank = check_training(world_size, name)
    want = per_rank[0]["ref_mse"]
    for rank, r in enumerate(per_rank):
        assert r["validated"] == per_rank[0]["validated"] and r["tested"] == per_rank[0]["tested"], rank
        (validated,) = r["validated"]
        (tested,) = r["tested"]
        assert set(validated) == {"val_loss", "val_mse"} and set(tested) == {"test_loss", "test_mse"}, r
        # The validation at the end of fit's epoch ran on the same (final) weights.
        for key in ("val_loss", "val_mse"):
            assert r["metrics"][key] == validated[key], (rank, key, r["metrics"], validated)
        for key, got in [*validated.items(), *tested.items()]:
            assert rel(got, want) <= TOL, (rank, key, got, want)
        # trainer.predict returns, and a BasePredictionWriter writes, each replica's predictions once: on its stage 0.
        dp = world_size // PP
        if r["pp_rank"] != 0:
            assert r["predict_none"] and r["written_batches"] == 0, (rank, r)
            continue
        assert not r["predict_none"], (rank, r)
        assert r["predict_rows"] == EVAL_SAMPLES // dp, r
        assert r["predict_batches"] == -(-EVAL_SAMPLES // dp // BATCH), r
        assert r["predict_err"] <= TOL, (rank, r["predict_err"])


@pytest.mark.timeout(T)
def test_logged_values_identical_on_every_rank() -> None:
    """self.log values and trainer.callback_metrics are the same on every stage, and equal the plain run's."""
    for case in WORLD2_CASES:
        per_rank = case_results(2, case.name)
        assert per_rank[0]["metrics"] == per_rank[1]["metrics"], (case.name, per_rank)
        metrics, losses = per_rank[0]["metrics"], per_rank[0]["ref_losses"][0]
        # dp = 1: synchronizing over the (single-rank) replicas leaves a value as it is, a sum included.
        assert metrics["train_loss_sync"] == metrics["train_loss_sum"] == metrics["train_loss"], (case.name, metrics)
        assert rel(metrics["train_loss"], losses[-1]) <= TOL, (case.name, metrics, losses)
        assert rel(metrics["epoch_loss"], sum(losses) / len(losses)) <= TOL, (case.name, metrics, losses)


@pytest.mark.timeout(T)
def test_sync_dist_reduces_over_data_parallel_replicas() -> None:
    """pp=2 × dp=2: sync_dist gives the mean (or sum) over the two replicas, not over the four ranks."""
    per_rank = case_results(4, "dp_accumulate_clip_norm")
    local = [per_rank[PP * d]["metrics"]["train_loss"] for d in range(2)]
    ref_local = [per_rank[0]["ref_losses"][d][-1] for d in range(2)]
    for rank, r in enumerate(per_rank):
        m = r["metrics"]
        assert m["train_loss"] == local[r["dp_rank"]], rank  # the same on the stages of one pipeline
        for key in ("train_loss_sync", "train_loss_sum", "epoch_loss"):
            assert m[key] == per_rank[0]["metrics"][key], (rank, key)  # the same everywhere
    m = per_rank[0]["metrics"]
    assert rel(m["train_loss_sync"], sum(local) / 2) <= TOL, (m, local)
    assert rel(m["train_loss_sum"], sum(local)) <= TOL, (m, local)  # not ×2 (over the world) nor ×4
    assert rel(m["train_loss_sync"], sum(ref_local) / 2) <= TOL, (m, ref_local)
    all_losses = [v for d in per_rank[0]["ref_losses"] for v in d]
    assert rel(m["epoch_loss"], sum(all_losses) / len(all_losses)) <= TOL, (m, all_losses)


@pytest.mark.timeout(T)
def test_reduce_boolean_decision_over_all_ranks() -> None:
    per_rank = case_results(2, "checkpoint_top_k")
    assert [r["all_true"] for r in per_rank] == [True, True]
    assert [r["any_rank0"] for r in per_rank] == [True, True]


@pytest.mark.timeout(T)
def test_model_checkpoint_top_k_keeps_the_best() -> None:
    """ModelCheckpoint(monitor="train_loss", save_top_k=1), every step: the best is the smallest logged loss."""
    per_rank = case_results(2, "checkpoint_top_k")
    losses = per_rank[0]["ref_losses"][0]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best != 0  # otherwise the first checkpoint would be the right one by luck
    for r in per_rank:
        assert rel(r["best_score"], losses[best]) <= TOL, (r["best_score"], losses)
        assert r["best_path"] == f"epoch=0-step={best + 1}.ckpt", r["best_path"]
