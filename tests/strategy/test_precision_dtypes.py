"""A float64 (or bf16) module under GPipeStrategy keeps its dtype: the plain run's weights, loss and logged values."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, LR, STEPS, Net, TinyHooked, dataset, lightning_module

CLIP = 0.05
F64_TOL = {"rtol": 1e-12, "atol": 1e-15}


class LogsInside(TinyHooked):
    """Logs inside pipeline_loss too: per micro-batch there, combined over the step by the strategy."""

    def pipeline_loss(self, output, batch):
        loss = F.mse_loss(self.head(output), batch[1])
        self.log("inside", loss)
        self.log("inside_number", loss.item())
        return loss


def plain_fit(clip_by: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One device, float64, the loader's order under Lightning's injected sampler; the weights and each step's loss."""
    net = Net().double()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x_all, y_all = (t.double() for t in dataset().tensors)
    order = torch.tensor(list(DistributedSampler(dataset(), num_replicas=1, rank=0, seed=0)))
    losses = []
    for step in range(STEPS):
        idx = order[step * BATCH : (step + 1) * BATCH]
        opt.zero_grad()
        loss = F.mse_loss(net(x_all[idx]), y_all[idx])
        loss.backward()
        losses.append(loss.item())
        if clip_by == "norm":
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        else:
            torch.nn.utils.clip_grad_value_(net.parameters(), CLIP)
        opt.step()
    return {k: v.detach().clone() for k, v in net.named_parameters()}, losses


def fit_worker(rank: int, world_size: int, clip_by: str, inside: bool) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = LogsInside() if inside else lightning_module()
    steps: list[dict[str, tuple[str, float]]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen = {"returned": outputs["loss"], **trainer.callback_metrics}
            steps.append({k: (str(v.dtype), v.item()) for k, v in seen.items()})

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, pipeline_parallel_size=2),
        precision="64-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm=clip_by,
        callbacks=[Record()],
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return {"params": {k: v.tolist() for k, v in module.named_parameters()}, "steps": steps}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("clip_by", "inside"), [("norm", False), ("value", True)], ids=["norm", "value-loss-inside"])
def test_float64_fit_equals_the_plain_float64_run(clip_by: str, inside: bool) -> None:
    want, losses = plain_fit(clip_by)
    for rank, got in enumerate(run_distributed(fit_worker, 2, clip_by, inside, timeout=100, lightning=True)):
        assert len(got["params"]) > 4, rank  # the replicated prefix and head, and this stage's layers
        for name, value in got["params"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), want[name], **F64_TOL)
        keys = {"returned", "train_loss", *(("inside", "inside_number") if inside else ())}
        for step, (seen, loss) in enumerate(zip(got["steps"], losses, strict=True)):
            assert set(seen) == keys, (rank, step, seen)
            for key, (dtype, value) in seen.items():
                assert dtype == "torch.float64", (rank, step, key)
                assert value == pytest.approx(loss, rel=1e-12), (rank, step, key)


def bf16_worker(rank: int, world_size: int) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    steps: list[dict[str, tuple[str, float]]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen = {"returned": outputs["loss"], **trainer.callback_metrics}
            steps.append({k: (str(v.dtype), v.item()) for k, v in seen.items()})

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, pipeline_parallel_size=2),
        precision="bf16-true",
        max_steps=2,
        accumulate_grad_batches=3,  # Lightning divides the bf16 loss by 3, in bf16
        callbacks=[Record()],
    )
    trainer.fit(LogsInside(), DataLoader(dataset(), batch_size=BATCH))
    return {"steps": steps}


@pytest.mark.timeout(120)
def test_a_bf16_loss_inside_is_returned_and_logged_as_bf16() -> None:
    """As in the plain run: Lightning keeps a bf16 value logged, in float32 (its dtype for logs below float32)."""
    for rank, got in enumerate(run_distributed(bf16_worker, 2, timeout=100, lightning=True)):
        assert len(got["steps"]) == 6, rank
        for step, seen in enumerate(got["steps"]):
            assert seen["returned"][0] == "torch.bfloat16", (rank, step, seen)
            for key in ("inside", "train_loss"):
                dtype, value = seen[key]
                assert dtype == "torch.float32" and value == torch.tensor(value).bfloat16().item(), (rank, step, key)
            # Logged as a number: Lightning converts it to float32 as the plain run's, no rounding to bf16.
            assert seen["inside_number"][0] == "torch.float32", (rank, step, seen)
