"""With interleaving (v = 2 per rank), Lightning's validate and predict loops and a resumed fit are the plain
run's: the forward-only pipeline goes around the ring v times; resumed from a single file or a DCP folder."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.pipeline_loss_fit import HookModule
from tests.helpers.tiny_fit import BATCH, dataset

TOL = 1e-6
BATCHES = 3  # training steps per epoch


class Evaluated(HookModule):
    """HookModule with a validation loss through pipeline_loss and predictions of the whole model."""

    steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_run += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_loss(self.backbone(self.prefix(batch[0])), batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(batch[0])))


def run(strategy: Any, devices: int, ckpt: str | None, epochs: int) -> tuple[Evaluated, dict, Any]:
    """Fit for ``epochs`` of BATCHES steps (resumed from ``ckpt``: an epoch's end), then validate and predict."""
    module = Evaluated()
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_epochs=epochs, limit_train_batches=BATCHES)
    # The shuffled order a pipeline of one replica reads (Lightning's DistributedSampler, seed 0), in both runs.
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, seed=0)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, sampler=sampler), ckpt_path=ckpt)
    validated = trainer.validate(module, DataLoader(dataset(), batch_size=BATCH))
    predicted = trainer.predict(module, DataLoader(dataset(), batch_size=BATCH))
    return module, validated[0], predicted


def worker(rank: int, world_size: int, out: str, distributed: bool) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")

    def strategy() -> GPipeStrategy:
        return GPipeStrategy(chunks=4, schedule="interleaved-1f1b", virtual_stages=2, save_distributed_checkpoint=False)

    module, _, _ = run(strategy(), world_size, None, 1)
    module.trainer.save_checkpoint(f"{out}/half.ckpt")
    module, validated, predicted = run(strategy(), world_size, f"{out}/half.ckpt", 2)
    return {
        "params": {n: p.detach().tolist() for n, p in module.named_parameters()},
        "steps_run": module.steps_run,
        "validated": validated,
        "predicted": None if predicted is None else torch.cat(predicted).tolist(),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [False, True], ids=["one-file", "dcp-folder"])
def test_interleaved_validate_predict_and_resume_are_the_plain_run(tmp_path: Any, distributed: bool) -> None:
    results = run_distributed(worker, 2, str(tmp_path), distributed, timeout=280, lightning=True)
    warnings.simplefilter("ignore")
    plain, validated, predicted = run("auto", 1, None, 2)  # the same steps without the resume
    want = torch.cat(predicted)
    expected = dict(plain.named_parameters())
    for rank, r in enumerate(results):
        assert r["steps_run"] == BATCHES, r["steps_run"]  # the second fit resumed: it ran the second epoch only
        for name, value in r["params"].items():
            ref = expected[name].detach()
            assert ((torch.tensor(value) - ref).abs().max() / ref.abs().max()).item() <= TOL, (rank, name)
        assert abs(r["validated"]["val_loss"] - validated["val_loss"]) <= TOL * validated["val_loss"], (rank, r)
    # trainer.predict returns the predictions on the pipeline's stage 0, None on the others.
    assert results[1]["predicted"] is None
    got = torch.tensor(results[0]["predicted"])
    assert got.shape == want.shape and (got - want).abs().max().item() <= TOL * want.abs().max().item()
    assert F.mse_loss(got, want).item() < 1e-12
