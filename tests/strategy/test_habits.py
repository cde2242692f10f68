"""The same run as one device for the models and habits users have: timm models plugged in as their users would,
a backbone held under two names, a weight tied across the backbone's boundary, frozen and unused parameters,
torchmetrics, a frozen feature extractor, and value-dependent logging with ``output="placeholder"``.

Each scenario compares every parameter and buffer (≤ 1e-6 relative, fp32) with a plain single-process run of the
same module (dp-averaged over replicas' different shards where dp > 1). One world-2 launch runs the pp = 2
scenarios one after another, one world-4 launch the pp = 2 × dp = 2 ones; the tests read the cached results. The
modules and the plain reference are ``tests/helpers/habits_modules.py``.
"""

from __future__ import annotations

import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import models
from tests.helpers.habits_modules import (
    BATCH,
    EVAL,
    PP,
    SCENARIOS,
    STEPS,
    habit_module,
    make_module,
    plain_run,
    probe_parts,
    rel_err,
    scenario_data,
    vit_parts,
)
from tests.helpers.launch import quiet_trainer, run_distributed

TOL = 1e-6


# ------------------------------------------------------------------------------------------------ the scenarios
def fit_scenario(name: str, world_size: int, workdir: str) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    spec = SCENARIOS[name]
    module = make_module(spec)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = GPipeStrategy(
        chunks=spec.get("chunks", 4),
        pipeline_parallel_size=PP,
        backbone=spec.get("path", "backbone"),
        batch_dim=spec.get("batch_dim", 0),
        balance=spec.get("balance", "parameters"),
        save_distributed_checkpoint=False,
        data_loading=spec.get("data_loading", "every_stage"),
        data_parallel=spec.get("data_parallel", "ddp"),
    )
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(scenario_data(spec["data"]), batch_size=BATCH))
    ckpt = f"{workdir}/{name}.ckpt"
    trainer.save_checkpoint(ckpt)
    plain = plain_run(spec, world_size // PP)
    want = plain.state_dict()
    got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
    errors = {
        k: rel_err(v, want[k]) if v.is_floating_point() else float(not torch.equal(v, want[k])) for k, v in got.items()
    }
    out: dict[str, Any] = {"errors": errors, "keys": sorted(got), "moved": {}}
    out["warned"] = [str(w.message) for w in caught if str(w.message).startswith("GPipeStrategy")]
    # What the checkpoint file holds: exactly the plain module's keys and trained values.
    if trainer.is_global_zero:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        out["file_keys_equal"] = sorted(saved) == sorted(want)
        out["file_max_error"] = max(
            rel_err(v, want[k]) if v.is_floating_point() else float(not torch.equal(v, want[k]))
            for k, v in saved.items()
        )
    stage = strategy.stage
    out["loss_inside"] = strategy._loss_inside is not None
    out["stage_numel"] = sum(p.numel() for p in stage.parameters())
    out["sharded"] = sum(isinstance(p, DTensor) for p in stage.parameters())
    out["whole_numel"] = sum(p.numel() for p in spec["build"]()["vit" if "vit" in name else "backbone"].parameters())
    if name == "vit_alias":
        out["alias_is_stage"] = module.vit.blocks is stage and module.backbone is stage
    for k in ("norm.weight", "unused.weight", "backbone.0.0.weight"):  # frozen at step 2, never used
        if k in got:
            out["moved"][k] = (got[k] - initial[k]).abs().max().item()
    return out


def loss_logging_scenario(world_size: int) -> str:
    """output="placeholder": a step that logs only when its output is non-zero logs on the last stage only."""
    from lightning_gpipe.strategy import GPipeStrategy

    def loss(self: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = self.backbone(self.prefix(x))
        if out.abs().sum() > 0:  # zeros on every stage but the last
            self.log("nonzero_outputs", 1.0)
        return F.mse_loss(self.head(out), y)

    module = habit_module(probe_parts, loss)
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=PP, output="placeholder"),
        max_steps=2,
    )
    try:
        trainer.fit(module, DataLoader(scenario_data("vectors"), batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def metrics_scenario(world_size: int, output: str) -> dict[str, Any]:
    """torchmetrics states (sum, mean, cat, confusion matrix) logged with self.log and computed by hand."""
    import lightning.pytorch as pl
    from torchmetrics import CatMetric, MeanMetric, SumMetric
    from torchmetrics.classification import MulticlassConfusionMatrix

    from lightning_gpipe.strategy import GPipeStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)
            for name, m in probe_parts().items():
                setattr(self, name, m)
            self.logged_count, self.logged_mean = SumMetric(), MeanMetric()
            self.count, self.mean, self.cat = SumMetric(), MeanMetric(), CatMetric()
            self.confusion = MulticlassConfusionMatrix(num_classes=models.D)
            self.by_hand: dict[str, torch.Tensor] = {}

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            out = self.head(self.backbone(self.prefix(x)))
            ones = torch.ones(len(x))
            self.logged_count.update(ones)
            self.logged_mean.update(out.mean(-1))
            self.log("val_count", self.logged_count)
            self.log("val_mean", self.logged_mean)
            self.count.update(ones)
            self.mean.update(out.mean(-1))
            self.cat.update(out.argmax(-1).float())
            self.confusion.update(out.argmax(-1), y)

        def on_validation_epoch_end(self) -> None:
            self.by_hand = {
                "count": self.count.compute(),
                "mean": self.mean.compute(),
                "cat": self.cat.compute().sort().values,
                "confusion": self.confusion.compute(),
            }

    module = Module()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(EVAL, models.D, generator=g)
    y = torch.randint(0, models.D, (EVAL,), generator=g)
    with torch.no_grad():
        out = module.head(module.backbone(module.prefix(x)))
    want = {
        "count": torch.tensor(float(EVAL)),
        "mean": out.mean(),
        "cat": out.argmax(-1).float().sort().values,
        "confusion": torch.bincount(y * models.D + out.argmax(-1), minlength=models.D**2).reshape(models.D, models.D),
    }
    trainer = quiet_trainer(
        devices=world_size, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=PP, output=output)
    )
    trainer.validate(module, DataLoader(TensorDataset(x, y), batch_size=6))
    logged = {"count": trainer.callback_metrics["val_count"], "mean": trainer.callback_metrics["val_mean"]}
    return {
        "by_hand": {k: (v.float() - want[k].float()).abs().max().item() for k, v in module.by_hand.items()},
        "logged": {k: (v.float() - want[k].float()).abs().max().item() for k, v in logged.items()},
        "count": module.by_hand["count"].item(),
    }


def _guard(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return {"traceback": traceback.format_exc()}


def world_worker(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    workdir = tempfile.mkdtemp() if rank == 0 else ""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name in names:
        if name == "loss_logging":
            out[name] = _guard(loss_logging_scenario, world_size)
        elif name.startswith("metrics"):
            out[name] = _guard(metrics_scenario, world_size, name.removeprefix("metrics_"))
        else:
            if dist.is_initialized():  # the file goes where rank 0 says (the Trainer makes the group on first fit)
                box = [workdir]
                dist.broadcast_object_list(box, 0)
                workdir = box[0]
            out[name] = _guard(fit_scenario, name, world_size, workdir or tempfile.mkdtemp())
    return out


WORLD2 = ["metrics_all", "vit_alias", "vit_dotted", "vit_inside", "vit_fed", "resnet_bn", "tied_frozen_unused",
          "frozen_backbone", "counter", "time_major", "metrics_placeholder",
          "loss_logging"]  # fmt: skip
WORLD4 = ["metrics_all", "tied_frozen_unused", "fsdp_tied_frozen_unused", "fsdp_vit_inside"]


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_distributed(world_worker, 2, WORLD2, timeout=400, lightning=True)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_distributed(world_worker, 4, WORLD4, timeout=400, lightning=True)


def _check_fit(results: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(results):
        r = r[name]
        assert "traceback" not in r, f"rank {rank}:\n{r.get('traceback')}"
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOL, (rank, worst, r["errors"][worst])
        assert len(r["errors"]) > 4, r["keys"]
    assert results[0][name]["file_keys_equal"], "the checkpoint file holds exactly the plain module's keys"
    assert results[0][name]["file_max_error"] <= TOL


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "name",
    [
        "vit_alias",
        "vit_dotted",
        "vit_inside",
        "vit_fed",
        "resnet_bn",
        "tied_frozen_unused",
        "frozen_backbone",
        "counter",
        "time_major",
    ],
)
def test_pp2_equals_plain(world2: list[dict[str, Any]], name: str) -> None:
    _check_fit(world2, name)
    r = world2[0][name]
    if name.startswith("vit"):  # memory ∝ the stage: stage 0 holds half of the blocks, or one of four (uneven)
        blocks = sum(p.numel() for p in vit_parts(False)["vit"].blocks.parameters())
        assert r["stage_numel"] == (blocks // 4 if name == "vit_alias" else blocks // 2), (r["stage_numel"], blocks)
    if name == "vit_alias":
        assert all(w[name]["alias_is_stage"] for w in world2)
    assert all(w[name]["loss_inside"] == (name in ("vit_inside", "vit_fed")) for w in world2)
    if name == "tied_frozen_unused":
        assert r["moved"]["unused.weight"] == 0.0  # no made-up zero gradient for AdamW to decay
        assert "backbone.0.0.weight" in r["moved"]
    # Only the stage holding the counter warns, naming its buffer; deferred BatchNorm changes nothing in forward.
    warned = [w[name]["warned"] for w in world2]
    if name == "counter":
        assert sorted(len(w) for w in warned) == [0, 1], warned  # the stage holding it, once
        message = warned[0][0] if warned[0] else warned[1][0]
        assert "backbone.4.seen" in message and "once per micro-batch" in message, message
    else:
        assert warned == [[], []], warned


@pytest.mark.timeout(420)
def test_pp2_dp2_tied_frozen_unused(world4: list[dict[str, Any]]) -> None:
    _check_fit(world4, "tied_frozen_unused")
    assert all(w["tied_frozen_unused"]["moved"]["unused.weight"] == 0.0 for w in world4)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["fsdp_tied_frozen_unused", "fsdp_vit_inside"])
def test_pp2_dp2_with_sharded_replicas(world4: list[dict[str, Any]], name: str) -> None:
    """data_parallel="fsdp": a tie between the embedding outside and the last layer, a layer frozen mid-run and a
    module never used (no gradient on any replica); timm's ViT blocks with the loss inside."""
    _check_fit(world4, name)
    assert all(w[name]["sharded"] for w in world4)
    if name == "fsdp_tied_frozen_unused":
        assert all(w[name]["moved"]["unused.weight"] == 0.0 for w in world4)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("world", "name"), [(2, "metrics_all"), (2, "metrics_placeholder"), (4, "metrics_all")])
def test_metrics_equal_the_plain_run(world2: list, world4: list, world: int, name: str) -> None:
    for rank, r in enumerate(world2 if world == 2 else world4):
        r = r[name]
        assert "traceback" not in r, f"rank {rank}:\n{r.get('traceback')}"
        assert r["count"] == EVAL, (rank, r)  # not K (or K × dp) times the samples
        for kind in ("by_hand", "logged"):
            for metric, err in r[kind].items():
                assert err <= 1e-6, (rank, kind, metric, err)


@pytest.mark.timeout(420)
def test_value_dependent_logging_with_output_placeholder_fails_clearly(world2: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(world2):
        message = r["loss_logging"]
        assert "output='placeholder'" in message and "must not depend" in message and "nonzero_outputs" in message, (
            rank,
            message,
        )


def test_plain_reference_is_not_trivial() -> None:
    """The scenarios' plain runs move the weights (so that equality with them means something)."""
    spec = SCENARIOS["tied_frozen_unused"]
    before = make_module(spec).state_dict()
    after = plain_run(spec, 1).state_dict()
    assert rel_err(after["embed.weight"], before["embed.weight"]) > 1e-3
    assert torch.equal(after["unused.weight"], before["unused.weight"])
