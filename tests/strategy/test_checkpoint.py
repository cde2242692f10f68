"""Checkpoints: a run saved and resumed continues exactly as an uninterrupted one, folder or single file."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

TOL = 1e-6


def _fit(pp: int, world_size: int, epochs: int, distributed: bool, ckpt_path: str | None = None):
    from lightning_gpipe.strategy import GPipeStrategy

    module = lightning_module(momentum=0.9)  # momentum buffers make the optimizer state matter
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, pipeline_parallel_size=pp, save_distributed_checkpoint=distributed),
        max_epochs=epochs,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, module


def resume_worker(rank: int, world_size: int, folder: str, distributed: bool) -> dict[str, float]:
    warnings.simplefilter("ignore")
    _, straight = _fit(2, world_size, 2, distributed)
    first, _ = _fit(2, world_size, 1, distributed)
    path = str(Path(folder) / "epoch1.ckpt")
    first.save_checkpoint(path)
    kind = "folder" if Path(path).is_dir() else "file" if Path(path).is_file() else "missing"
    resumed_trainer, resumed = _fit(2, world_size, 2, distributed, ckpt_path=path)
    ref = dict(straight.named_parameters())
    err = max(((p - ref[n]).abs().max() / ref[n].abs().max()).item() for n, p in resumed.named_parameters())
    return {"err": err, "kind": kind, "steps": resumed_trainer.global_step}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [True, False])
def test_resume_continues_identically(tmp_path: Path, distributed: bool) -> None:
    results = run_distributed(resume_worker, 2, str(tmp_path), distributed, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["kind"] == ("folder" if distributed else "file"), r
        assert r["steps"] == 16, r
        assert r["err"] <= TOL, (rank, r)
    if not distributed:
        # One ordinary Lightning checkpoint whose state_dict has exactly the plain module's keys.
        saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
        assert set(saved["state_dict"]) == set(lightning_module().state_dict())


def _named_state(trainer, module) -> dict[str, torch.Tensor]:
    """Weights and momentum buffers by global parameter name."""
    names = {id(p): n for n, p in module.named_parameters()}
    state = {n: p.detach().clone() for n, p in module.named_parameters()}
    for p, s in trainer.optimizers[0].state.items():
        state[f"momentum:{names[id(p)]}"] = s["momentum_buffer"].clone()
    return state


def layout_worker(
    rank: int, world_size: int, folder: str, distributed: bool, saved_pp: int = 2, loaded_pp: int = 1
) -> dict[str, float]:
    warnings.simplefilter("ignore")
    saved_trainer, saved_module = _fit(saved_pp, world_size, 1, distributed)
    path = str(Path(folder) / "pp2.ckpt")
    saved_trainer.save_checkpoint(path)
    saved = _named_state(saved_trainer, saved_module)
    # The same processes in another (pp × dp) layout: each rank restores its new stage from the old stages' parts.
    loaded_trainer, loaded_module = _fit(loaded_pp, world_size, 1, distributed, ckpt_path=path)
    loaded = _named_state(loaded_trainer, loaded_module)
    common = saved.keys() & loaded.keys()
    err = max((loaded[k] - saved[k]).abs().max().item() for k in common)
    return {
        "err": err,
        "saved": sorted(saved),
        "loaded": sorted(loaded),
        "common": len(common),
        "steps": [saved_trainer.global_step, loaded_trainer.global_step],
        # Plain lists: the main process compares what a rank loaded with what any rank saved.
        "saved_values": {k: v.tolist() for k, v in saved.items()},
        "loaded_values": {k: v.tolist() for k, v in loaded.items()},
    }


def _layout_states(results: list[dict], key: str) -> set[str]:
    return {name for r in results for name in r[key]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [True, False])
def test_resume_into_another_layout(tmp_path: Path, distributed: bool) -> None:
    """pp = 2 → pp = 1 × dp = 2: each rank now holds every layer."""
    results = run_distributed(layout_worker, 2, str(tmp_path), distributed, timeout=280, lightning=True)
    total = len(lightning_module().state_dict()) * 2  # weights and momentum buffers of the whole model
    for r in results:
        assert r["err"] == 0.0, r
        assert len(r["loaded"]) == total and r["steps"] == [8, 8], r
    # Together the two stages' states cover the whole model (each rank compared its own stage plus replicas).
    assert len(_layout_states(results, "saved")) == total
    if distributed:
        # Lightning's own tool turns the folder into one file that the plain (unpipelined) module loads strictly.
        consolidated = tmp_path / "consolidated.ckpt"
        tool = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint"]
        subprocess.run([*tool, str(tmp_path / "pp2.ckpt"), "--output_file", str(consolidated)], check=True)
        plain = lightning_module()
        plain.load_state_dict(torch.load(consolidated, weights_only=False)["state_dict"], strict=True)


@pytest.mark.timeout(300)
def test_resume_with_pipeline_and_data_parallel_sizes_both_changed(tmp_path: Path) -> None:
    """4 processes: pp = 2 × dp = 2 → pp = 4 × dp = 1; every weight and momentum buffer restored exactly."""
    results = run_distributed(layout_worker, 4, str(tmp_path), True, 2, 4, timeout=280, lightning=True)
    total = len(lightning_module().state_dict()) * 2
    saved = {k: v for r in results for k, v in r["saved_values"].items()}
    assert len(saved) == total
    for rank, r in enumerate(results):
        assert r["steps"] == [4, 4], r  # one epoch of 48 samples in batches of 6 per replica, 2 replicas
        assert r["loaded_values"], r
        for name, value in r["loaded_values"].items():  # exactly what the old layout saved
            assert value == saved[name], (rank, name)
    assert len(_layout_states(results, "loaded")) == total  # the four new stages hold the whole model together


def _trainer_with_checkpoints(folder: str, world_size: int, callbacks: list):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpipe.strategy import GPipeStrategy

    checkpoint = ModelCheckpoint(
        dirpath=folder, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=1
    )
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3),
        max_steps=6,
        callbacks=[checkpoint, *callbacks],
        enable_checkpointing=True,
    )
    return trainer, checkpoint


def _validation_step(self, batch, batch_idx):
    x, y = batch
    self.log("val_loss", torch.nn.functional.mse_loss(self.head(self.backbone(self.prefix(x))), y))


def callback_worker(rank: int, world_size: int, folder: str) -> dict[str, object]:
    import lightning.pytorch as pl

    warnings.simplefilter("ignore")
    losses: list[float] = []
    snapshots: list[dict[str, torch.Tensor]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            snapshots.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    trainer, checkpoint = _trainer_with_checkpoints(folder, world_size, [Record()])
    module = lightning_module()
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    kept = sorted(p.name for p in Path(folder).iterdir())
    # ckpt_path="last" finds the callback's last checkpoint and restores this stage's part of it.
    again, _ = _trainer_with_checkpoints(folder, world_size, [])
    restored = lightning_module()
    again.fit(restored, DataLoader(dataset(), batch_size=BATCH), ckpt_path="last")
    final = {n: p.detach().clone() for n, p in module.named_parameters()}
    err = max((p - final[n]).abs().max().item() for n, p in restored.named_parameters())
    # ckpt_path="best": the first trainer's ModelCheckpoint knows the best step; its weights come back exactly.
    module.validation_step = _validation_step.__get__(module)
    trainer.validate(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path="best", verbose=False)
    best_step = min(range(len(losses)), key=losses.__getitem__)
    best = snapshots[best_step]
    best_err = max((p - best[n]).abs().max().item() for n, p in module.named_parameters())
    moved = max((final[n] - best[n]).abs().max().item() for n in best)  # the best is not simply the last state
    return {
        "losses": losses,
        "kept": kept,
        "best": Path(checkpoint.best_model_path).name,
        "best_score": float(checkpoint.best_model_score),
        "last_err": err,
        "last_step": again.global_step,
        "best_err": best_err,
        "best_vs_last": moved,
    }


@pytest.mark.timeout(300)
def test_model_checkpoint_top_k_and_resume_from_last(tmp_path: Path) -> None:
    results = run_distributed(callback_worker, 2, str(tmp_path), timeout=280, lightning=True)
    r = results[0]
    assert results[0]["kept"] == results[1]["kept"] and results[0]["best"] == results[1]["best"]
    losses = r["losses"]
    best_two = sorted(range(len(losses)), key=losses.__getitem__)[:2]
    assert r["best_score"] == pytest.approx(min(losses), rel=1e-6)
    assert r["best"] == f"epoch=0-step={best_two[0] + 1}.ckpt", (r, losses)
    step_folders = sorted(k for k in r["kept"] if k.startswith("epoch="))
    assert step_folders == sorted(f"epoch=0-step={s + 1}.ckpt" for s in best_two), (r, losses)
    assert "last.ckpt" in r["kept"]
    for name in r["kept"]:
        assert (tmp_path / name / "meta.pt").is_file()  # every kept checkpoint is a complete DCP folder
    for result in results:
        assert result["last_step"] == 6 and result["last_err"] == 0.0, result
        assert result["best_err"] == 0.0, result
    if best_two[0] != len(losses) - 1:
        assert all(result["best_vs_last"] > 0 for result in results)
