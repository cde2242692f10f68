"""Checkpoints of sharded replicas (``data_parallel="fsdp"``): a folder or one file, resumed in another layout (pp,
dp, ddp ↔ fsdp) with every weight and AdamW moment exactly as saved; the file holds the plain module's keys."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyPipelined, dataset


class Adam(TinyPipelined):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _fit(layout: tuple[str, int], world_size: int, distributed: bool, ckpt_path: str | None = None) -> Any:
    from lightning_gpipe.strategy import GPipeStrategy

    data_parallel, pp = layout
    module = Adam()
    strategy = GPipeStrategy(
        chunks=3, pipeline_parallel_size=pp, data_parallel=data_parallel, save_distributed_checkpoint=distributed
    )
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_epochs=1, precision="64-true")
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, module


def _whole(t: torch.Tensor) -> list:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().tolist()


def _named_state(trainer: Any, module: Any) -> dict[str, list]:
    """Weights and AdamW moments by global parameter name, whole (a shard gathered: every replica calls it)."""
    names = {id(p): n for n, p in module.named_parameters()}
    state = {n: _whole(p) for n, p in module.named_parameters()}
    for p, s in trainer.optimizers[0].state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}:{names[id(p)]}"] = _whole(s[key])
    return state


def _worker(rank: int, world_size: int, folder: str, distributed: bool, saved: tuple, loaded: tuple) -> dict:
    warnings.simplefilter("ignore")
    trainer, module = _fit(saved, world_size, distributed)
    path = Path(folder) / "run.ckpt"
    trainer.save_checkpoint(path)
    before = _named_state(trainer, module)
    file_keys = None
    if path.is_file():  # what a plain Trainer resumes: the module's keys, whole tensors, torch's optimizer format
        saved_file = torch.load(path, weights_only=False)
        file_keys = sorted(saved_file["state_dict"])
        plain = Adam()
        plain.load_state_dict(saved_file["state_dict"], strict=True)
        plain.configure_optimizers().load_state_dict(saved_file["optimizer_states"][0])
        moments = [t for st in saved_file["optimizer_states"][0]["state"].values() for t in st.values()]
        tensors = [*saved_file["state_dict"].values(), *moments]
        assert not any(isinstance(t, DTensor) for t in tensors)
        shapes = {tuple(p.shape) for p in plain.parameters()}
        assert all(tuple(t.shape) in shapes for t in moments if t.dim())  # whole, not shards
    resumed_trainer, resumed = _fit(loaded, world_size, distributed, ckpt_path=str(path))
    after = _named_state(resumed_trainer, resumed)
    sharded = sorted(n for n, p in resumed.named_parameters() if isinstance(p, DTensor))
    # The weights alone, into a run that starts afresh (fine-tuning): zeroed first, so that each must be read.
    from lightning_gpipe.strategy._checkpoint_files import load_weights

    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    load_weights(path, resumed)
    weights = {n: _whole(p) for n, p in resumed.named_parameters()}
    return {"before": before, "after": after, "file_keys": file_keys, "sharded": sharded, "weights": weights}


LAYOUTS = [
    (True, ("fsdp", 2), ("ddp", 2)),
    (True, ("ddp", 2), ("fsdp", 2)),
    (True, ("fsdp", 2), ("fsdp", 4)),  # pp = 2 × dp = 2 → pp = 4 × dp = 1
    (False, ("fsdp", 2), ("ddp", 4)),
    (False, ("ddp", 2), ("fsdp", 2)),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("distributed", "saved", "loaded"),
    LAYOUTS,
    ids=[f"{'folder' if d else 'file'}-{s[0]}{s[1]}-to-{lo[0]}{lo[1]}" for d, s, lo in LAYOUTS],
)
def test_sharded_checkpoints_resume_in_any_layout(
    tmp_path: Path, distributed: bool, saved: tuple, loaded: tuple
) -> None:
    results = run_distributed(_worker, 4, str(tmp_path), distributed, saved, loaded, timeout=280, lightning=True)
    whole = {k: v for r in results for k, v in r["before"].items()}
    plain = TinyPipelined().state_dict()
    assert len(whole) == 3 * len(plain)  # every weight, with its two moments, saved by some rank
    for rank, r in enumerate(results):
        # Each rank resumed its new stage with the values the old layout held: exactly, before any new step.
        assert r["after"], rank
        for name, value in r["after"].items():
            assert value == whole[name], (rank, name)
        for name, value in r["weights"].items():
            assert value == whole[name], (rank, name)
        if "fsdp" in loaded:
            assert r["sharded"] and all(n.startswith("backbone.") for n in r["sharded"]), r["sharded"]
        if not distributed:
            assert r["file_keys"] == sorted(plain), r["file_keys"]  # the plain module's keys, whole tensors
