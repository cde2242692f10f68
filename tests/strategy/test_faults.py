"""Faults: a rank killed mid-step makes the others exit within the timeout; training then resumes from "last"."""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

TIMEOUT_S = 8


def _trainer(folder: str, epochs: int, callbacks: list):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpipe.strategy import GPipeStrategy

    return quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(chunks=2, timeout=timedelta(seconds=TIMEOUT_S)),
        max_epochs=epochs,
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True), *callbacks],
        enable_checkpointing=True,
    )


def crash_worker(rank: int, world_size: int, folder: str) -> dict[str, object]:
    import lightning.pytorch as pl

    warnings.simplefilter("ignore")

    class KillStage1(pl.Callback):
        """Stage 1 dies in the middle of the second epoch's third step, after the forward phase."""

        def on_before_backward(self, trainer, pl_module, loss):
            if rank == 1 and trainer.current_epoch == 1 and trainer.fit_loop.epoch_loop.batch_idx == 2:
                os._exit(1)
            self.last = time.monotonic()

    killer = KillStage1()
    try:
        _trainer(folder, 2, [killer]).fit(lightning_module(), DataLoader(dataset(), batch_size=BATCH))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - killer.last}
    return {"error": None}


def resume_worker(rank: int, world_size: int, folder: str) -> dict[str, float]:
    warnings.simplefilter("ignore")
    resumed = lightning_module()
    trainer = _trainer(folder, 2, [])
    trainer.fit(resumed, DataLoader(dataset(), batch_size=BATCH), ckpt_path="last")
    straight = lightning_module()
    _trainer(str(Path(folder) / "straight"), 2, []).fit(straight, DataLoader(dataset(), batch_size=BATCH))
    ref = dict(straight.named_parameters())
    err = max(((p - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in resumed.named_parameters())
    return {"err": err, "steps": trainer.global_step}


@pytest.mark.timeout(300)
def test_killed_rank_then_resume_from_last(tmp_path: Path) -> None:
    crashed = run_distributed(crash_worker, 2, str(tmp_path), timeout=120, lightning=True, allow_missing=True)
    assert crashed[1] is None  # the killed process reported nothing
    survivor = crashed[0]
    assert survivor["error"] is not None, survivor
    assert "stage 1" in survivor["error"], survivor
    assert survivor["after_s"] < 3 * TIMEOUT_S, survivor  # within the strategy's timeout, not the default 30 min
    assert (tmp_path / "last.ckpt").exists()
    for r in run_distributed(resume_worker, 2, str(tmp_path), timeout=150, lightning=True):
        assert r["steps"] == 16 and r["err"] <= 1e-6, r
