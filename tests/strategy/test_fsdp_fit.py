"""GPipeStrategy(data_parallel="fsdp"): pp = 2 × dp = 2 with each replica holding a shard of its stage is the same run
as one device (float64, AdamW, different data per replica), for every schedule with the loss inside and outside."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.helpers import models
from tests.helpers.launch import counted_fsdp_collectives, quiet_trainer, run_distributed
from tests.helpers.pipeline_loss_fit import loader
from tests.helpers.tiny_fit import BATCH, STEPS, TinyHooked, TinyPipelined, dataset

TOL = 1e-9


def _module(case: dict[str, Any]) -> Any:
    """The tiny module with the case's loss path, backbone and optimizer; its losses recorded per step."""

    class Module(TinyPipelined if case["schedule"] is None else TinyHooked):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []
            if case.get("model") == "tied":  # a weight tied between the first and the last stage's layers
                self.backbone[7].weight = self.backbone[0][0].weight
            if case.get("model") == "tied_within":  # between two layers of the first stage
                self.backbone[3].weight = self.backbone[1].weight
            if case.get("model") == "bn":
                torch.manual_seed(5)
                self.backbone = models.with_bn()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if case.get("optimizer") == "sgd":  # scale-sensitive: a wrong clipping norm shows
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            # Adam's moments are held as shards too; the decay touches every weight.
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.pipeline_loss(self.backbone(self.prefix(batch[0])), batch))

    return Module()


def _fit(module: Any, devices: int, strategy: Any, case: dict[str, Any], dp: int) -> Any:
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=STEPS // case.get("accumulate", 1),  # one epoch: the plain run's sampler has no later epochs
        precision="64-true",
        gradient_clip_val=case.get("clip"),
        sync_batchnorm=case.get("model") == "bn" and devices > 1,
        accumulate_grad_batches=case.get("accumulate", 1),
        # After every batch: inside each window the layers are resharded with their gradients still whole.
        val_check_interval=1 if case.get("validate") else None,
        limit_val_batches=1 if case.get("validate") else 0,
    )
    trainer.fit(module, loader(devices, dp), loader(devices, dp) if case.get("validate") else None)
    return trainer


def _worker(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = _module(case)
    options = {"schedule": case["schedule"]} if case["schedule"] else {"pipeline_loss": False}
    strategy = GPipeStrategy(
        chunks=case.get("chunks", 4),
        pipeline_parallel_size=2,
        data_parallel="fsdp",
        virtual_stages=case.get("v", 1),
        activation_checkpointing=case.get("checkpoint", "except_last"),
        reshard_after_forward=case.get("reshard", False),
        **options,
    )
    with counted_fsdp_collectives() as calls:
        trainer = _fit(module, world_size, strategy, case, dp=2)
    sharded = {n: p for n, p in module.named_parameters() if isinstance(p, DTensor)}
    units = len(_layers(list(sharded)))
    plain = _module(case)
    _fit(plain, 1, "auto", case, dp=2)  # the plain run on this process, the replicas' batches joined
    expected = dict(plain.state_dict())
    mine = module.state_dict()  # parameters and BatchNorm's running statistics, of this stage and outside
    weights = {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().sub(expected[n]).abs().max().item()
        for n, t in mine.items()
        if t.is_floating_point()
    }
    return {
        "weights": max(weights.values()),
        "sharded": sorted(sharded),
        "calls": calls,
        "dp_rank": trainer.strategy.device_mesh["data_parallel"].get_local_rank(),
        "pp_rank": trainer.strategy.device_mesh["pipeline_parallel"].get_local_rank(),
        "units": units,
        "losses": module.losses,
        "plain_losses": plain.losses,
    }


CASES = [
    {"schedule": None},
    {"schedule": None, "clip": 0.05, "optimizer": "sgd", "checkpoint": "always"},
    {"schedule": "gpipe", "chunks": 3},  # 6 samples a replica in 3 micro-batches; the next case's 4: uneven
    {"schedule": "1f1b", "clip": 0.05, "optimizer": "sgd"},
    {"schedule": "zb-h1", "model": "tied"},
    {"schedule": "1f1b", "model": "tied_within"},
    {"schedule": "interleaved-1f1b", "v": 2, "checkpoint": "never"},
    {"schedule": "gpipe", "model": "bn", "chunks": 1},  # BatchNorm synchronized over the replicas (M = 1)
    {"schedule": "gpipe", "reshard": True},
    {"schedule": "1f1b", "reshard": True, "checkpoint": "never"},
    {"schedule": None, "reshard": True},
    {"schedule": "gpipe", "accumulate": 2, "validate": True},
    {"schedule": "1f1b", "accumulate": 2, "validate": True, "reshard": True},
]


def _id(case: dict[str, Any]) -> str:
    return "-".join(f"{v}" for v in [case["schedule"] or "loss_outside", *list(case.values())[1:]])


def _layers(names: list[str]) -> set[str]:
    return {".".join(n.split(".")[:2]) for n in names}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_sharded_replicas_train_as_one_device(case: dict[str, Any]) -> None:
    results = run_distributed(_worker, 4, case, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["weights"] <= TOL, (rank, r)
        # Backbone layers sharded; the prefix and head (on every stage) whole.
        assert r["sharded"] and all(n.startswith("backbone.") for n in r["sharded"]), r["sharded"]
        # Each sharded layer gathered once a step for all M micro-batches, its gradient reduce-scattered once.
        once = STEPS // case.get("accumulate", 1) * r["units"]
        if case.get("validate"):  # gathered again after each validation let the layers go; reduced once a window
            assert r["calls"]["reduce_scatter"] == once and r["calls"]["all_gather"] > once, r["calls"]
        elif not case.get("reshard"):
            assert r["calls"] == {"all_gather": once, "reduce_scatter": once}, r["calls"]
        else:  # gathered again after each forward freed it: M + 1 to 2M + 1 times a step; reduced once still
            M = case.get("chunks", 4)
            assert (M + 1) * once <= r["calls"]["all_gather"] <= (2 * M + 1) * once, r["calls"]
            assert r["calls"]["reduce_scatter"] == once, r["calls"]
    module = _module(case)
    layers = _layers([n for n, p in module.named_parameters(remove_duplicate=False) if n.startswith("backbone.")])
    # Summed over the stages, or one weight of two layers of a stage: whole.
    tied = {"tied": {"backbone.0", "backbone.7"}, "tied_within": {"backbone.1", "backbone.3"}}.get(
        case.get("model"), set()
    )
    assert _layers([n for r in results for n in r["sharded"]]) == layers - tied
    plain = results[0]["plain_losses"]
    assert len(plain) == STEPS
    # layout="auto" puts a stage's replicas on consecutive ranks under fsdp: rank k·D + d.
    assert [(r["pp_rank"], r["dp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    replicas = [r["losses"] for r in results if r["pp_rank"] == 0]
    for step in range(len(plain)):  # each step's loss: the mean of the two replicas' (equal batch sizes)
        mean = (replicas[0][step] + replicas[1][step]) / 2
        assert abs(mean - plain[step]) <= TOL * max(1.0, abs(plain[step])), (step, mean, plain[step])


def _precision_worker(rank: int, world_size: int, precision: str) -> dict[str, Any]:
    """The same fit at pp = 2 × dp = 2 under ``precision``, replicas whole (ddp) and sharded (fsdp)."""
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    weights, dtypes = {}, {}
    for data_parallel in ("ddp", "fsdp"):
        module = _module({"schedule": "1f1b"})
        # One layout for both, so that each rank holds the same stage in the two runs.
        strategy = GPipeStrategy(
            chunks=3, pipeline_parallel_size=2, schedule="1f1b", data_parallel=data_parallel, layout="stages_together"
        )
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS, precision=precision)
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
        params = dict(module.named_parameters())
        weights[data_parallel] = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).float() for n, p in params.items()
        }
        dtypes[data_parallel] = sorted({str(p.dtype) for n, p in params.items() if isinstance(p, DTensor)})
    worst = max(((weights["fsdp"][n] - w).abs().max() / w.abs().max()).item() for n, w in weights["ddp"].items())
    return {"worst": worst, "dtypes": dtypes}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_precision_plugins_hold_under_sharding(precision: str) -> None:
    """bf16-true shards the converted bf16 weights (and AdamW's moments with them); bf16-mixed keeps fp32 shards
    and autocasts the gathered weights as the plain run does: the ddp run's weights either way (two replicas' sum
    has one order and halving it is exact: bf16 too agrees to the bit, measured 0.0)."""
    results = run_distributed(_precision_worker, 4, precision, timeout=280, lightning=True)
    want = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
    for rank, r in enumerate(results):
        assert r["dtypes"]["fsdp"] == [want], (rank, r)
        assert r["worst"] <= 1e-6, (rank, r)
