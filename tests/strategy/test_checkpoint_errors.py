"""A checkpoint that cannot be saved or resumed: one clear error, the same on every rank, and the ranks stay in step."""

from __future__ import annotations

import pathlib
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module


def _trainer(world_size: int, single_file: bool, max_steps: int = 1):
    from lightning_gpipe.strategy import GPipeStrategy

    strategy = GPipeStrategy(chunks=2, save_distributed_checkpoint=not single_file)
    return quiet_trainer(devices=world_size, strategy=strategy, max_steps=max_steps)


def _error(action, *args, **kwargs) -> str:
    try:
        action(*args, **kwargs)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _full_disk(save):
    def full_disk(obj, f, *args, **kwargs):
        if isinstance(f, str | Path):
            raise OSError(28, "No space left on device")
        return save(obj, f, *args, **kwargs)

    return full_disk


def _forbidden(self, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(self))


def failed_save_worker(rank: int, world_size: int, folder: str) -> dict[str, str]:
    warnings.simplefilter("ignore")
    out = {}
    for single_file in (True, False):
        kind = "file" if single_file else "folder"
        trainer = _trainer(world_size, single_file)
        trainer.fit(lightning_module(), DataLoader(dataset(), batch_size=BATCH))
        blocker = Path(folder) / "a_file"
        if rank == 0:
            blocker.write_text("not a directory")
        trainer.strategy.barrier()
        out[f"{kind}, not a directory"] = _error(trainer.save_checkpoint, blocker / "sub" / "x.ckpt")

        save = torch.save
        if rank == 0:  # rank 0 only, as a full disk: the file, or the folder's meta.pt (the shards are streams)
            torch.save = _full_disk(save)
        out[f"{kind}, disk full on rank 0"] = _error(trainer.save_checkpoint, Path(folder) / f"{kind}.ckpt")
        torch.save = save

        if not single_file:  # every rank creates the folder (rank 0 alone writes a single file)
            mkdir = pathlib.Path.mkdir
            if rank == 1:  # a directory this rank's machine may not create
                pathlib.Path.mkdir = _forbidden
            out["folder, no mkdir on rank 1"] = _error(trainer.save_checkpoint, Path(folder) / "new" / "x.ckpt")
            pathlib.Path.mkdir = mkdir

        # The ranks are still in step: the next save works.
        good = Path(folder) / f"good-{kind}.ckpt"
        trainer.save_checkpoint(good)
        out[f"{kind}, then"] = "saved" if good.is_file() or (good / "meta.pt").is_file() else "missing"
        trainer.strategy.barrier()
        if rank == 0:
            blocker.unlink()
            shutil.rmtree(Path(folder) / "new", ignore_errors=True)
        trainer.strategy.barrier()
    return out


@pytest.mark.timeout(300)
def test_failed_save_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(failed_save_worker, 2, str(tmp_path), timeout=280, lightning=True)
    assert results[0] == results[1], results
    out = results[0]
    file_error = (
        f"RuntimeError: could not save the checkpoint {str(tmp_path / 'a_file' / 'sub' / 'x.ckpt')!r} (rank 0: "
    )
    assert out["file, not a directory"].startswith(file_error), out
    assert "it was not written. Save to a path that is writable" in out["file, not a directory"], out
    full = "(rank 0: OSError: [Errno 28] No space left on device)"
    assert out["file, disk full on rank 0"].startswith(
        f"RuntimeError: could not save the checkpoint {str(tmp_path / 'file.ckpt')!r} {full}"
    ), out
    assert out["folder, disk full on rank 0"].startswith(
        f"RuntimeError: could not save the checkpoint folder {str(tmp_path / 'folder.ckpt')!r} {full}; it is "
        "incomplete (no meta.pt) and cannot be resumed"
    ), out
    folder_error = (
        f"RuntimeError: could not save the checkpoint folder {str(tmp_path / 'a_file' / 'sub' / 'x.ckpt')!r} "
        "(every rank: NotADirectoryError"
    )
    assert out["folder, not a directory"].startswith(folder_error), out
    assert "rank 1: PermissionError: [Errno 13] Permission denied" in out["folder, no mkdir on rank 1"], out
    assert "rank 0" not in out["folder, no mkdir on rank 1"], out
    assert out["file, then"] == out["folder, then"] == "saved", out


def broken_folder_worker(rank: int, world_size: int, folder: str) -> dict[str, object]:
    from lightning_gpipe.strategy._checkpoint_files import load_weights

    warnings.simplefilter("ignore")
    trainer = _trainer(world_size, False)
    module = lightning_module()
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    interrupted = Path(folder) / "interrupted.ckpt"
    trainer.save_checkpoint(interrupted)
    trainer.strategy.barrier()
    if rank == 0:
        (interrupted / "meta.pt").unlink()  # as a save stopped before rank 0 wrote it
        (Path(folder) / "something else").mkdir()
    trainer.strategy.barrier()
    out: dict[str, object] = {}
    for name in ("interrupted.ckpt", "something else", "nowhere.ckpt"):
        again = _trainer(world_size, False, max_steps=2)
        out[name] = _error(
            again.fit, lightning_module(), DataLoader(dataset(), batch_size=BATCH), ckpt_path=str(Path(folder) / name)
        )
    # What the message offers for the interrupted save: its weights, into a fresh (here unpipelined) module.
    fresh = lightning_module()
    load_weights(interrupted, fresh)
    saved = dict(module.named_parameters())
    out["weights"] = max((p - saved[n]).abs().max().item() for n, p in fresh.named_parameters() if n in saved)
    return out


@pytest.mark.timeout(300)
def test_folder_without_metadata_is_refused_clearly(tmp_path: Path) -> None:
    results = run_distributed(broken_folder_worker, 2, str(tmp_path), timeout=280, lightning=True)
    for key in ("interrupted.ckpt", "something else", "nowhere.ckpt"):
        assert results[0][key] == results[1][key], (key, results)
    out = results[0]
    interrupted = str(tmp_path / "interrupted.ckpt")
    assert out["interrupted.ckpt"] == (
        f"FileNotFoundError: cannot resume from the folder {interrupted!r}: it has no meta.pt, the file rank 0 writes "
        "last in a GPipeStrategy checkpoint folder (loops, callbacks, epoch). Its save was interrupted, or it is not a "
        "checkpoint; resume from another checkpoint (ckpt_path=...). Its weights are complete (torch's .metadata is "
        "there): start a fresh run from them with lightning_gpipe.strategy._checkpoint_files.load_weights("
        f"Path({interrupted!r}), module)"
    ), out
    assert out["something else"].endswith("Its tensors are incomplete too (no .metadata)"), out
    assert out["nowhere.ckpt"] == (
        f"FileNotFoundError: no checkpoint at {str(tmp_path / 'nowhere.ckpt')!r} (a Lightning .ckpt file, or a "
        "GPipeStrategy checkpoint folder)"
    ), out
    for r in results:
        assert r["weights"] == 0.0, r
