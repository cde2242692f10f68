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


def killed_under_nccl_rules_worker(rank: int, world_size: int, pp: int) -> dict[str, object]:
    """The last stage of the last replica dies mid-step, after its forward phase, with the transport's tensors on
    the link groups and each group's transfers run in posting order (NCCL's rules, ``nccl_order``)."""
    import lightning.pytorch as pl

    from lightning_gpipe.pipe.comm.nccl_order import ENV
    from lightning_gpipe.strategy import GPipeStrategy

    os.environ[ENV] = "1"
    warnings.simplefilter("ignore")

    class KillLastRank(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if rank == world_size - 1 and trainer.fit_loop.epoch_loop.batch_idx == 2:
                os._exit(1)
            self.last = time.monotonic()

    killer = KillLastRank()
    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=pp, timeout=timedelta(seconds=TIMEOUT_S))
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_epochs=1, callbacks=[killer])
    try:
        trainer.fit(lightning_module(), DataLoader(dataset(), batch_size=BATCH))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - killer.last}
    return {"error": None}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world_size", "pp"), [(2, 2), (4, 2)])
def test_a_killed_rank_ends_every_other_under_nccl_rules_within_the_timeout(world_size: int, pp: int) -> None:
    """At dp = 1 and at pp 2 × dp 2: every surviving rank raises (its pipeline's peer lost, or its data-parallel
    peer gone) within the strategy's timeout + 5 s of the kill, not at NCCL's or torch's 10-minute default."""
    results = run_distributed(
        killed_under_nccl_rules_worker, world_size, pp, timeout=150, lightning=True, allow_missing=True
    )
    assert results[-1] is None  # the killed process reported nothing
    for rank, r in enumerate(results[:-1]):
        assert r is not None and r["error"] is not None, (rank, r)
        assert r["after_s"] < TIMEOUT_S + 5, (rank, r)
    # The killed rank's pipeline peer names what it lost.
    assert f"stage {pp - 1}" in results[-2]["error"], results[-2]
