"""The loss inside the pipeline (``pipeline_loss``): the same run, logs and metrics as the plain Trainer's."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.pipeline_loss_fit import LOGGED, HookModule, fit
from tests.helpers.tiny_fit import BATCH, STEPS, TOL, TinyPipelined, dataset


def worker(rank: int, world_size: int, pp: int, schedule: str, accumulate: int, clip: float | None) -> dict:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(chunks=4, pipeline_parallel_size=pp, schedule=schedule)
    module, metrics = fit(strategy, world_size, 1, accumulate, clip)
    return {
        "params": {n: p.detach().tolist() for n, p in module.named_parameters()},
        "metrics": metrics,
        "micro": strategy._loss_inside is not None,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "pp", "schedule", "accumulate", "clip"),
    [
        (2, 2, "1f1b", 1, None),
        (2, 2, "gpipe", 2, 0.05),
        (4, 2, "1f1b", 1, 0.05),
        (3, 3, "1f1b", 1, None),
        (2, 2, "zb-h1", 2, 0.05),
        (4, 2, "zb-h1", 1, 0.05),  # the dp mean leaves during the last W
    ],
)
def test_loss_inside_the_pipeline_is_the_plain_run(
    world_size: int, pp: int, schedule: str, accumulate: int, clip: float | None
) -> None:
    """Weights equal the plain Trainer's (≤ 1e-6); on dp = 1 every logged value and the metric's epoch state too,
    on every stage: the loss, a torchmetrics object updated per micro-batch, a mean and a sum logged inside."""
    dp = world_size // pp
    results = run_distributed(worker, world_size, pp, schedule, accumulate, clip, timeout=280, lightning=True)
    warnings.simplefilter("ignore")
    plain, plain_metrics = fit("auto", 1, dp, accumulate, clip)
    expected = dict(plain.named_parameters())
    for rank, r in enumerate(results):
        assert r["micro"], "pipeline_loss defined: the loss ran inside the pipeline"
        assert len(r["params"]) > 4, rank
        for name, value in r["params"].items():
            ref = expected[name].detach().cpu()
            err = ((torch.tensor(value) - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL, (rank, name, err)
        if dp == 1:
            for key in (*LOGGED, "train_mse_epoch"):
                got, want = r["metrics"][key], plain_metrics[key]
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, key, got, want)
    for start in range(0, world_size, pp):  # every stage of a pipeline logged the same values
        assert len({tuple(sorted(r["metrics"].items())) for r in results[start : start + pp]}) == 1


class ManualHook(HookModule):
    """Manual optimization: zero_grad, pipeline_loss, manual_backward, step, in the user's order."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.pipeline_loss(self.backbone(self.prefix(batch[0])), batch)
        opt.zero_grad()  # after the pipeline ran: its gradients wait for manual_backward
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)
        return loss


def manual_worker(rank: int, world_size: int) -> dict:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = ManualHook()
    trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=3), max_steps=STEPS)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return {n: p.detach().tolist() for n, p in module.named_parameters()}


@pytest.mark.timeout(200)
def test_manual_optimization_with_the_loss_inside_the_pipeline() -> None:
    results = run_distributed(manual_worker, 2, timeout=180, lightning=True)
    warnings.simplefilter("ignore")
    plain, _ = fit("auto", 1, 1, 1, None, ManualHook)
    expected = dict(plain.named_parameters())
    for rank, params in enumerate(results):
        for name, value in params.items():
            ref = expected[name].detach().cpu()
            err = ((torch.tensor(value) - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL, (rank, name, err)


class OutsideTerm(HookModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.pipeline_loss(self.backbone(self.prefix(x)), batch) + 0.1 * self.prefix.weight.square().sum()


class MarkerMisuse(HookModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.backbone(self.prefix(x))), y)


class BatchStatistic(HookModule):
    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        pred = self.head(output)
        return F.mse_loss(pred - pred.mean(0), batch[1])  # centred on the batch: not a mean of per-sample terms


class SumOverSamples(HookModule):
    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.head(output), batch[1], reduction="sum")  # a sum: needs pipeline_loss_denominator = 1


def misuse_worker(rank: int, world_size: int, kind: str) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    kinds = {"outside": OutsideTerm, "marker": MarkerMisuse, "statistic": BatchStatistic, "sum": SumOverSamples}
    module = kinds[kind]()
    trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=2), max_steps=1)
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    except Exception as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("outside", "move every term of the loss into it"),
        ("marker", "pass it straight to self.pipeline_loss"),
        ("statistic", "pipeline_loss does not add up over micro-batches: the loss is"),
        ("sum", "define pipeline_loss_denominator(batch)"),
    ],
)
def test_misuse_fails_on_every_rank_with_the_fix(kind: str, says: str) -> None:
    for rank, message in enumerate(run_distributed(misuse_worker, 2, kind, timeout=180, lightning=True)):
        assert says in message, (rank, message)


@pytest.mark.parametrize(("module", "setting"), [(TinyPipelined(), "auto"), (HookModule(), False)])
def test_a_schedule_with_the_loss_outside_is_refused(module: Any, setting: Any) -> None:
    """schedule='1f1b' orders the loss-inside step only; with the loss outside it would silently run GPipe's order."""
    from lightning_gpipe.strategy._pipeline_loss import PipelineLoss

    with pytest.raises(ValueError, match=r"schedule='1f1b'.*loss runs outside.*leave schedule='gpipe'"):
        PipelineLoss.choose(module, setting, None, "1f1b")
    assert PipelineLoss.choose(module, setting, None, "gpipe") is None


def bf16_worker(rank: int, world_size: int) -> dict[str, dict]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    weights = {}
    for schedule in ("1f1b", "zb-h1"):
        module = HookModule()
        strategy = GPipeStrategy(chunks=4, pipeline_parallel_size=2, schedule=schedule)
        trainer = quiet_trainer(devices=world_size, strategy=strategy, precision="bf16-mixed", max_steps=STEPS)
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
        weights[schedule] = {n: p.detach().tolist() for n, p in module.named_parameters()}
    return weights


@pytest.mark.timeout(200)
def test_zb_h1_under_bf16_mixed_trains_as_1f1b_does() -> None:
    """Under autocast the deferred weight gradients use autocast's casts: the same weights as 1F1B's, bit for bit."""
    for rank, weights in enumerate(run_distributed(bf16_worker, 2, timeout=180, lightning=True)):
        assert len(weights["zb-h1"]) > 4 and weights["zb-h1"] == weights["1f1b"], rank
