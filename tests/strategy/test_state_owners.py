"""Which rank owns each tensor: layers also held outside the backbone (torchvision's children idiom), weight averages
(AveragedModel, timm's ModelEmaV3, Lightning's WeightAveraging and StochasticWeightAveraging), and what every
checkpoint holds: each holder's values and each saved key equal a plain ``Trainer(devices=1)`` run's (K = 2), and
at pp = 2 × dp = 2 each saved key is its owner's (``lightning_gpipe/strategy/_weight_copies.py``)."""

from __future__ import annotations

import tempfile
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers.launch import quiet_trainer, run_distributed

TOL = 1e-6
BATCH = 8


class TinyResNet(nn.Module):
    """torchvision's ResNet layout in miniature: conv + BatchNorm children, a pool and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, stride=2), nn.BatchNorm2d(6), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(6, 5)


def make(kind: str) -> Any:
    """``alias``: the children idiom; ``averaged``/``timm``: an EMA of the backbone made in ``__init__``, updated
    in ``on_train_batch_end`` and evaluated in validation; ``owners``: the alias, an EMA and a weight tied to a
    module outside; ``callback``/``swa``: the alias under Lightning's averaging callbacks."""
    import lightning.pytorch as pl
    from timm.utils.model_ema import ModelEmaV3
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.model = TinyResNet()
            # The layers are reachable as self.model.layer1 and as self.backbone.3.
            self.backbone = nn.Sequential(*list(self.model.children())[:-1], nn.Flatten(), nn.Linear(6, 6))
            self.extra = nn.Linear(6, 6)
            if kind == "owners":  # tied to the backbone's last layer, used outside it
                self.extra.weight = self.backbone[-1].weight
            if kind in ("averaged", "owners"):
                self.ema = AveragedModel(self.backbone, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
            if kind == "timm":
                self.ema = ModelEmaV3(self.backbone, decay=0.8)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model.fc(self.extra(self.backbone(x))), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if kind in ("averaged", "owners"):
                self.ema.update_parameters(self.backbone)
            elif kind == "timm":
                self.ema.update(self.backbone)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Evaluated(Module):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch  # under no_grad, as validation runs: the averaged copy runs the pipeline with its values
            self.log("val_ema", F.cross_entropy(self.model.fc(self.extra(self.ema(x))), y))

    return Evaluated() if kind in ("averaged", "timm") else Module()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 5, (32,), generator=g))


def callbacks(kind: str) -> list:
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging

    if kind == "callback":
        return [EMAWeightAveraging(decay=0.8)]
    return [StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)] if kind == "swa" else []


def fit(kind: str, devices: int, strategy: Any, epochs: int, ckpt_path: str | None = None) -> tuple[Any, Any]:
    module = make(kind)
    val = DataLoader(data(), batch_size=BATCH) if kind in ("averaged", "timm") else None
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_epochs=epochs, callbacks=callbacks(kind), limit_val_batches=2
    )
    # A pipelined run's loader gets Lightning's DistributedSampler (shuffled, seed 0): the plain run the same one.
    sampler = DistributedSampler(data(), num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer.fit(module, DataLoader(data(), batch_size=BATCH, sampler=sampler), val, ckpt_path=ckpt_path)
    return trainer, module


def arrays(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().clone().numpy() for k, v in module.state_dict().items()}


def saved_state(path: Path, entry: str = "state_dict") -> dict[str, torch.Tensor]:
    """What a checkpoint (file or DCP folder) holds under ``entry``."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)[entry]
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    found = {k: m for k, m in stored.items() if k.startswith(f"{entry}.") and hasattr(m, "size")}
    state = {
        entry: {k.removeprefix(f"{entry}."): torch.zeros(m.size, dtype=m.properties.dtype) for k, m in found.items()}
    }
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state[entry]


# ------------------------------------------------------------------------------------------------- the workers
EPOCHS = {"alias": 1, "averaged": 2, "timm": 2, "callback": 1, "swa": 2, "owners": 1}
RESUMED = ("alias", "callback")  # saved after epoch 1, resumed to epoch 2 from the file and from the folder


def strategy(distributed: bool) -> Any:
    from lightning_gpipe import GPipeStrategy

    return GPipeStrategy(
        chunks=1,
        pipeline_parallel_size=2,
        balance=[4, 4],
        save_distributed_checkpoint=distributed,
        timeout=timedelta(seconds=30),  # a rank that failed leaves the others at a collective: not for long
    )


def world_worker(rank: int, world_size: int, kinds: list[str], folder: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for kind in kinds:
        try:
            trainer, module = fit(kind, world_size, strategy(True), EPOCHS[kind])
            out[kind] = {"state": arrays(module), "val": float(trainer.callback_metrics.get("val_ema", float("nan")))}
            for distributed in (False, True):  # the same trained module, saved as each kind
                trainer.strategy.save_distributed_checkpoint = distributed
                trainer.save_checkpoint(f"{folder}/{kind}-{'dcp' if distributed else 'file'}.ckpt")
            if kind in RESUMED:
                for how in ("file", "dcp"):
                    _, resumed = fit(kind, world_size, strategy(True), 2, f"{folder}/{kind}-{how}.ckpt")
                    out[kind][f"resumed_{how}"] = arrays(resumed)
        except Exception:
            out[kind] = {"traceback": traceback.format_exc()}
            break  # the ranks may be out of step now
    return out


def plain(kind: str, folder: str, epochs: int, ckpt_path: str | None = None) -> tuple[dict[str, torch.Tensor], float]:
    trainer, module = fit(kind, 1, "auto", epochs, ckpt_path)
    trainer.save_checkpoint(f"{folder}/plain-{kind}-{epochs}.ckpt")
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, float(
        trainer.callback_metrics.get("val_ema", float("nan"))
    )


def worst(got: dict[str, Any], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    assert got and set(got) <= set(want), sorted(set(got) - set(want))
    errors = {}
    for k, v in got.items():
        a, b = torch.as_tensor(v).double(), want[k].double()
        errors[k] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    key = max(errors, key=errors.__getitem__)
    return key, errors[key]


KINDS = ["alias", "averaged", "timm", "callback", "swa"]


@pytest.fixture(scope="module")
def world2() -> tuple[list[dict[str, Any]], str]:
    folder = tempfile.mkdtemp()
    return run_distributed(world_worker, 2, KINDS, folder, timeout=400, lightning=True), folder


def _ok(results: list[dict[str, Any]], kind: str) -> None:
    for rank, r in enumerate(results):
        assert kind in r, f"rank {rank} stopped at an earlier scenario's error"
        assert "traceback" not in r[kind], f"rank {rank}:\n{r[kind]['traceback']}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", KINDS)
def test_every_holder_and_every_saved_key_equal_the_plain_run(world2: Any, kind: str) -> None:
    warnings.simplefilter("ignore")
    results, folder = world2
    _ok(results, kind)
    want, val = plain(kind, folder, EPOCHS[kind])
    for rank, r in enumerate(results):  # every name holding a layer, buffers included, and every averaged copy
        key, err = worst(r[kind]["state"], want)
        assert err <= TOL, (rank, key, err)
    if kind in ("averaged", "timm"):  # the average, evaluated through the pipeline
        assert abs(results[0][kind]["val"] - val) <= TOL * abs(val), (results[0][kind]["val"], val)
    reference = torch.load(f"{folder}/plain-{kind}-{EPOCHS[kind]}.ckpt", weights_only=False)
    entries = ["state_dict", "current_model_state"] if kind == "callback" else ["state_dict"]
    for how in ("file", "dcp"):
        for entry in entries:  # WeightAveraging: the average under state_dict, the live weights beside it
            saved = saved_state(Path(f"{folder}/{kind}-{how}.ckpt"), entry)
            assert sorted(saved) == sorted(reference[entry]), (how, entry)
            key, err = worst(saved, reference[entry])
            assert err <= TOL, (how, entry, key, err)
    if kind in RESUMED:
        # As the plain run resumes (WeightAveraging leaves the average in the module at the end of a fit).
        resumed, _ = plain(kind, folder, 2, f"{folder}/plain-{kind}-1.ckpt")
        for how in ("file", "dcp"):
            for rank, r in enumerate(results):
                key, err = worst(r[kind][f"resumed_{how}"], resumed)
                assert err <= TOL, (how, rank, key, err)


# --------------------------------------------------------------------------------- pp = 2 × dp = 2: the rule
def owners_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    trainer, module = fit("owners", world_size, strategy(False), 1)
    trainer.save_checkpoint(f"{folder}/owners-file.ckpt")
    trainer.strategy.save_distributed_checkpoint = True
    trainer.save_checkpoint(f"{folder}/owners-dcp.ckpt")
    return {"state": arrays(module), "stage": trainer.strategy.stage.index}


def owner(key: str) -> int:
    """The rule for this model (balance [4, 4]): layers 0–3 (conv1, bn1, relu, layer1) run on stage 0, under either
    name and in the EMA's copy; everything else is stage 1's (layer2 onwards, the head, the tied weight)."""
    layer = {"conv1": 0, "bn1": 1, "layer1": 3, "layer2": 4}
    parts = key.split(".")
    if parts[0] == "model" and parts[1] in layer:
        return int(layer[parts[1]] >= 4)
    if parts[0] == "backbone" or key.startswith("ema.module."):
        return int(int(parts[2 if parts[0] == "ema" else 1]) >= 4)
    return 1


@pytest.mark.timeout(300)
def test_each_saved_key_is_its_owners_value_at_pp2_dp2() -> None:
    folder = tempfile.mkdtemp()
    results = run_distributed(owners_worker, 4, folder, timeout=280, lightning=True)
    assert [r["stage"] for r in results] == [0, 1, 0, 1]
    differ = 0
    for how in ("file", "dcp"):
        saved = saved_state(Path(f"{folder}/owners-{how}.ckpt"))
        assert sorted(saved) == sorted(make("owners").state_dict()), how
        for key, value in saved.items():
            mine = results[owner(key)]["state"][key]  # replica 0's rank of the owning stage
            assert torch.equal(value, torch.as_tensor(mine)), (how, key)
            other = results[owner(key) + 2]["state"][key]  # replica 1's: its own running statistics
            differ += not np.array_equal(mine, other)
    assert differ > 0, "the replicas' running statistics differ: the rule decided which is saved"
    for rank, r in enumerate(results):  # aliased layers: every holder has its replica's stage-0 buffers
        names = [k for k in r["state"] if k.startswith("model.bn1.") or k.startswith("model.layer1.1.")]
        source = results[rank // 2 * 2]["state"]
        assert names and all(np.array_equal(r["state"][k], source[k]) for k in names)
