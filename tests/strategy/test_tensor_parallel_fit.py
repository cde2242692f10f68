"""GPipeStrategy(tensor_parallel_size=2): each stage's layers split over two ranks by torch's ``parallelize_module`` in
``configure_model`` (as under Lightning's ModelParallelStrategy) is the same run as one device (float64, AdamW), with
the pipeline, with data parallelism (whole or sharded replicas), built in ``__init__`` or on the meta device."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.models import D
from tests.helpers.pipeline_loss_fit import loader
from tests.helpers.tiny_fit import BATCH, STEPS, dataset

TOL = 1e-9


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))


class Split(pl.LightningModule):
    """A prefix, 4 blocks (an up and a down projection: Megatron's MLP pair) and a head; each block's pair split over
    the tensor-parallel ranks in ``configure_model``, its output whole on each of them."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        self.case = case
        self.losses: list[float] = []
        if not case.get("meta"):
            self._build()

    def _build(self) -> None:
        torch.manual_seed(3)
        self.prefix, self.backbone, self.head = (
            nn.Linear(D, D),
            nn.Sequential(*[_block() for _ in range(4)]),
            nn.Linear(D, D),
        )

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if not hasattr(self, "backbone"):
            self._build()
        mesh = self.device_mesh
        if mesh is None or isinstance(self.backbone[0][0].weight, DTensor):
            return  # the plain run, or already split
        for block in self.backbone:
            parallelize_module(block, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.case["schedule"] is None:
            return F.mse_loss(self.head(self.backbone(self.prefix(x))), y)
        return self.pipeline_loss(self.backbone(self.prefix(x)), batch)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.head(output), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.case.get("optimizer") == "sgd":  # scale-sensitive: a wrong clipping norm shows
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(module: Split, devices: int, strategy: Any, case: dict[str, Any], dp: int) -> Any:
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_steps=STEPS, precision="64-true", gradient_clip_val=case.get("clip")
    )
    trainer.fit(module, loader(devices, dp))
    return trainer


def _worker(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Split(case)
    K = case["pp"]
    options = {"schedule": case["schedule"]} if case["schedule"] else {"pipeline_loss": False}
    strategy = GPipeStrategy(
        chunks=3,
        pipeline_parallel_size=K,
        tensor_parallel_size=2,
        data_parallel=case.get("data_parallel", "ddp"),
        **options,
    )
    trainer = _fit(module, world_size, strategy, case, dp=world_size // (2 * K))
    plain = Split(case)
    if case.get("meta"):  # built on the meta device and materialized as the strategy does, in one process
        from lightning_gpipe.strategy._materialize import materialize, record_init

        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # as "64-true" builds it: drawn in float64
        try:
            with torch.device("meta"), record_init() as record:
                plain.configure_model()
            # The seed the strategy draws from: the process's, which _build set.
            materialize(plain, dict(plain.named_modules()), torch.device("cpu"), torch.initial_seed(), record)
        finally:
            torch.set_default_dtype(default)
    plain.configure_model()
    _fit(plain, 1, "auto", case, dp=world_size // (2 * K))
    expected = dict(plain.state_dict())
    weights = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().sub(expected[n]).abs().max().item()
        for n, t in module.state_dict().items()
    }
    mesh = trainer.strategy.device_mesh
    return {
        "weights": max(weights.values()),
        "checked": sorted(weights),
        "split": sorted(n for n, p in module.named_parameters() if isinstance(p, DTensor)),
        "losses": module.losses,
        "plain_losses": plain.losses,
        "coords": [mesh[d].get_local_rank() for d in ("data_parallel", "pipeline_parallel", "tensor_parallel")],
    }


CASES = [
    {"pp": 2, "schedule": None},
    {"pp": 2, "schedule": "gpipe", "clip": 0.05, "optimizer": "sgd"},
    {"pp": 2, "schedule": "zb-h1"},
    {"pp": 2, "schedule": "1f1b", "meta": True},
    {"pp": 1, "schedule": "gpipe", "clip": 0.05, "optimizer": "sgd"},  # dp = 2 × tp = 2, replicas whole
    {"pp": 1, "schedule": "gpipe", "data_parallel": "fsdp"},  # dp = 2 × tp = 2, replicas sharded: 2-D
    {"pp": 1, "schedule": None},
]


def _id(case: dict[str, Any]) -> str:
    return "-".join(f"{k}_{v}" for k, v in case.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_tensor_parallel_stages_train_as_one_device(case: dict[str, Any]) -> None:
    results = run_distributed(_worker, 4, case, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["weights"] <= TOL, (rank, r)
        # Every block's two projections split over the tensor-parallel ranks; the prefix and head whole.
        assert r["split"] and all(n.startswith("backbone.") for n in r["split"]), r["split"]
    # Tensor-parallel ranks are neighbours (innermost in the mesh).
    assert [r["coords"][2] for r in results] == [0, 1, 0, 1]
    plain = results[0]["plain_losses"]
    dp = 4 // (2 * case["pp"])
    replicas = [r["losses"] for r in results if r["coords"][1:] == [0, 0]]
    assert len(plain) == STEPS and len(replicas) == dp
    for step in range(STEPS):  # each step's loss: the mean of the replicas' (equal batch sizes)
        mean = sum(losses[step] for losses in replicas) / dp
        assert abs(mean - plain[step]) <= TOL * max(1.0, abs(plain[step])), (step, mean, plain[step])


def _checkpoint_worker(rank: int, world_size: int, folder: str, distributed: bool) -> dict[str, Any]:
    """pp = 2 × tp = 2 saves; pp = 2 × dp = 2 without tensor parallelism resumes (each rank a whole stage)."""
    from pathlib import Path

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    case = {"pp": 2, "schedule": "gpipe"}

    def fit(T: int, ckpt: str | None = None) -> tuple[Any, Split]:
        module = Split(case)
        strategy = GPipeStrategy(
            chunks=3, pipeline_parallel_size=2, tensor_parallel_size=T, save_distributed_checkpoint=distributed
        )
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_epochs=1, precision="64-true")
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt)
        return trainer, module

    def whole(trainer: Any, module: Split) -> dict[str, list]:
        names = {id(p): n for n, p in module.named_parameters()}
        out = {n: (p.full_tensor() if isinstance(p, DTensor) else p).tolist() for n, p in module.named_parameters()}
        for p, s in trainer.optimizers[0].state.items():
            t = s["exp_avg"]
            out[f"exp_avg:{names[id(p)]}"] = (t.full_tensor() if isinstance(t, DTensor) else t).tolist()
        return out

    trainer, module = fit(2)
    path = Path(folder) / "tp.ckpt"
    trainer.save_checkpoint(path)
    before = whole(trainer, module)
    keys = sorted(torch.load(path, weights_only=False)["state_dict"]) if path.is_file() else None
    resumed_trainer, resumed = fit(1, str(path))
    return {"before": before, "after": whole(resumed_trainer, resumed), "keys": keys}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("distributed", [True, False], ids=["folder", "file"])
def test_tensor_parallel_checkpoints_resume_without_it(tmp_path: Any, distributed: bool) -> None:
    """The folder (each rank its part) and the single file (whole tensors, the plain module's keys) written at tp = 2
    resume at tp = 1 with every weight and moment as saved."""
    results = run_distributed(_checkpoint_worker, 4, str(tmp_path), distributed, timeout=280, lightning=True)
    saved = {k: v for r in results for k, v in r["before"].items()}
    plain = Split({"pp": 2, "schedule": "gpipe"})
    assert len(saved) == 2 * len(list(plain.parameters()))
    for rank, r in enumerate(results):
        assert r["after"], rank
        for name, value in r["after"].items():
            assert value == saved[name], (rank, name)
        if not distributed:
            assert r["keys"] == sorted(plain.state_dict()), r["keys"]


def _balance_worker(rank: int, world_size: int) -> dict[str, str]:
    """With an example_input_array, "auto" would count FLOPs on rank 0 alone: its split layers would wait there."""
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    out = {}
    for balance in ("auto", "flops"):
        module = Split({"pp": 2, "schedule": "gpipe"})
        module.example_input_array = torch.zeros(4, D)
        strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=2, tensor_parallel_size=2, balance=balance)
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=1)
        try:
            trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
            out[balance] = f"split {strategy.stage.balance}"
        except ValueError as e:
            out[balance] = str(e)
    return out


@pytest.mark.timeout(200)
def test_split_layers_are_balanced_by_parameters_not_measured_on_one_rank() -> None:
    for r in run_distributed(_balance_worker, 4, timeout=180, lightning=True):
        assert r["auto"] == "split [2, 2]", r
        assert "balance='flops') measures each layer on rank 0 alone" in r["flops"], r
        assert "balance='parameters' or explicit layer counts" in r["flops"], r
