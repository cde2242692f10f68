"""The same run as one device for the models and habits users have: timm models plugged in as their users would,
a backbone held under two names, a weight tied across the backbone's boundary, frozen and unused parameters,
torchmetrics, a frozen feature extractor, and value-dependent logging with ``output="placeholder"``.

Each scenario compares every parameter and buffer (≤ 1e-6 relative, fp32) with a plain single-process run of the
same module (dp-averaged over replicas' different shards where dp > 1). One world-2 launch runs the pp = 2
scenarios one after another, one world-4 launch the pp = 2 × dp = 2 ones; the tests read the cached results.
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
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers import models
from tests.helpers.launch import quiet_trainer, run_distributed

TOL = 1e-6
PP = 2
BATCH, STEPS, LR = 8, 4, 0.05
V = 11  # vocabulary of the tied language model
EVAL = 24


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_err(got, want) if got.is_floating_point() else float(not torch.equal(got, want))


# ------------------------------------------------------------------------------------------------------ modules
def _lightning_module(build: Callable[[], dict[str, nn.Module]], loss: Callable, opt: str = "sgd", **hooks: Any):
    """A LightningModule holding ``build()``'s submodules; ``loss(self, batch)`` is its training loss, or with hooks
    ``features`` and ``head`` the loss is ``self.pipeline_loss(self.backbone(features(self, x)), batch)``, which
    GPipeStrategy runs inside the pipeline (``loss`` stays the plain run's)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)
            for name, m in build().items():
                setattr(self, name, m)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if "before_step" in hooks:
                hooks["before_step"](self, self.global_step)
            if "head" in hooks:
                value = self.pipeline_loss(self.vit.blocks(hooks["features"](self, batch[0])), batch)
            else:
                value = loss(self, batch)
            self.log("train_loss", value)
            return value

        if "head" in hooks:

            def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
                return hooks["head"](self, output, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if opt == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return Module()


def _vit(alias: bool) -> dict[str, nn.Module]:
    import timm

    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16, depth=4, num_heads=2,
        num_classes=5,
    )  # fmt: skip
    # The natural way to pipeline a timm ViT: name its blocks as the backbone (the second name is an alias).
    return {"vit": vit, "backbone": vit.blocks} if alias else {"vit": vit}


def _vit_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(self.vit(x), y)


def _vit_features(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A timm ViT's forward_features up to its blocks."""
    vit = self.vit
    return vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))


def _vit_head(self: Any, output: torch.Tensor, batch: Any) -> torch.Tensor:
    """The rest of it: the final norm, the head and the loss, per micro-batch on the last stage."""
    return F.cross_entropy(self.vit.forward_head(self.vit.norm(output)), batch[1])


def _resnet() -> dict[str, nn.Module]:
    import timm

    net = timm.create_model("resnet18", pretrained=False, num_classes=5, stem_width=8, channels=(8, 16, 32, 64))
    trunk = nn.Sequential(net.conv1, net.bn1, net.act1, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4)
    return {"backbone": trunk, "pool": net.global_pool, "fc": net.fc}


def _resnet_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(self.fc(self.pool(self.backbone(x))), y)


def _tied_lm() -> dict[str, nn.Module]:
    """The usual LM/NMT tie: the embedding before the backbone is the backbone's last layer, the output projection."""
    embed = nn.Embedding(V, models.D)
    proj = nn.Linear(models.D, V, bias=False)
    proj.weight = embed.weight
    return {
        "embed": embed,
        "norm": nn.LayerNorm(models.D),  # frozen after two steps, as an embedding after warm-up
        "backbone": nn.Sequential(*models.mlp(4), proj),
        "unused": nn.Linear(models.D, models.D),  # never called: AdamW must not decay it
    }


def _tied_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(self.backbone(self.norm(self.embed(x))), y)


def _freeze(self: Any, step: int) -> None:
    if step == 2:
        self.norm.requires_grad_(False)
        self.backbone[0].requires_grad_(False)  # a backbone layer too (on stage 0; a no-op elsewhere)


def _frozen_backbone_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    with torch.no_grad():  # linear probing: a frozen feature extractor
        features = self.backbone(self.prefix(x))
    return F.mse_loss(self.head(features), y)


class Counter(nn.Module):
    """A layer with state: the number of samples it has seen (a buffer changed in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return x


def _counting() -> dict[str, nn.Module]:
    modules = _probe()
    modules["backbone"] = nn.Sequential(*modules["backbone"][:4], Counter(), *modules["backbone"][4:])
    return modules


def _counting_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(self.head(self.backbone(self.prefix(x))), y)


def _time_major() -> dict[str, nn.Module]:
    layers = [nn.TransformerEncoderLayer(models.D, 2, 16, dropout=0.0) for _ in range(4)]  # (T, N, D) by default
    return {"backbone": nn.Sequential(*layers), "head": nn.Linear(models.D, 5)}


def _time_major_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch  # (N, T, D) from the loader; the backbone takes (T, N, D)
    return F.cross_entropy(self.head(self.backbone(x.transpose(0, 1)).mean(0)), y)


def _probe() -> dict[str, nn.Module]:
    return {"prefix": nn.Linear(models.D, models.D), "backbone": models.mlp(), "head": nn.Linear(models.D, models.D)}


SCENARIOS: dict[str, dict[str, Any]] = {
    # Uneven: the alias used to keep the whole backbone, and an uneven split then died in a gloo size mismatch.
    "vit_alias": {"build": lambda: _vit(alias=True), "loss": _vit_loss, "data": "images", "balance": [1, 3]},
    "vit_dotted": {"build": lambda: _vit(alias=False), "loss": _vit_loss, "data": "images", "path": "vit.blocks"},
    # The same ViT with its head and loss in pipeline_loss, run per micro-batch on the last stage (N = 8, M = 3).
    "vit_inside": {
        "build": lambda: _vit(alias=False),
        "loss": _vit_loss,
        "data": "images",
        "path": "vit.blocks",
        "chunks": 3,
        "hooks": {"features": _vit_features, "head": _vit_head},
    },
    # The same, its batches loaded on stage 0 only and sent to stage 1 (data_loading="first_stage").
    "vit_fed": {
        "build": lambda: _vit(alias=False),
        "loss": _vit_loss,
        "data": "images",
        "path": "vit.blocks",
        "chunks": 3,
        "hooks": {"features": _vit_features, "head": _vit_head},
        "data_loading": "first_stage",
    },
    # BatchNorm normalizes each micro-batch: with M = 1 the pipelined run is the plain one exactly.
    "resnet_bn": {"build": _resnet, "loss": _resnet_loss, "data": "images", "chunks": 1},
    "tied_frozen_unused": {
        "build": _tied_lm,
        "loss": _tied_loss,
        "data": "tokens",
        "opt": "adamw",
        "hooks": {"before_step": _freeze},
    },
    "frozen_backbone": {"build": _probe, "loss": _frozen_backbone_loss, "data": "vectors"},
    # nn.TransformerEncoderLayer's default layout: the samples are dim 1, and the strategy is told so.
    "time_major": {"build": _time_major, "loss": _time_major_loss, "data": "sequences", "batch_dim": 1},
    # Counted once per micro-batch, never again in the recompute: N per step, as on one device.
    "counter": {"build": _counting, "loss": _counting_loss, "data": "vectors"},
}


def _data(kind: str, n: int = 64) -> TensorDataset:  # 4 steps of 8 on each of 2 replicas
    g = torch.Generator().manual_seed(0)
    if kind == "images":
        return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 5, (n,), generator=g))
    if kind == "sequences":
        return TensorDataset(torch.randn(n, 5, models.D, generator=g), torch.randint(0, 5, (n,), generator=g))
    if kind == "tokens":
        return TensorDataset(torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g))
    return TensorDataset(torch.randn(n, models.D, generator=g), torch.randn(n, models.D, generator=g))


def _make(spec: dict[str, Any]) -> Any:
    return _lightning_module(spec["build"], spec["loss"], spec.get("opt", "sgd"), **spec.get("hooks", {}))


def plain_run(spec: dict[str, Any], dp: int) -> Any:
    """The module trained without any strategy: each step averages the dp replicas' shards (DistributedSampler)."""
    module = _make(spec)
    module.train()
    opt = module.configure_optimizers()
    data = _data(spec["data"])
    shards = [list(DistributedSampler(data, num_replicas=dp, rank=d, seed=0)) for d in range(dp)]
    hook = spec.get("hooks", {}).get("before_step")
    for step in range(STEPS):
        opt.zero_grad()
        if hook is not None:
            hook(module, step)
        for shard in shards:
            idx = torch.tensor(shard[step * BATCH : (step + 1) * BATCH])
            (spec["loss"](module, (data.tensors[0][idx], data.tensors[1][idx])) / dp).backward()
        opt.step()
    return module


# ------------------------------------------------------------------------------------------------ the scenarios
def fit_scenario(name: str, world_size: int, workdir: str) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    spec = SCENARIOS[name]
    module = _make(spec)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = GPipeStrategy(
        chunks=spec.get("chunks", 4),
        pipeline_parallel_size=PP,
        backbone=spec.get("path", "backbone"),
        batch_dim=spec.get("batch_dim", 0),
        balance=spec.get("balance", "parameters"),
        save_distributed_checkpoint=False,
        data_loading=spec.get("data_loading", "every_stage"),
    )
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_data(spec["data"]), batch_size=BATCH))
    ckpt = f"{workdir}/{name}.ckpt"
    trainer.save_checkpoint(ckpt)
    plain = plain_run(spec, world_size // PP)
    want = plain.state_dict()
    got = module.state_dict()
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
    out["loss_inside"] = strategy._micro is not None
    out["stage_numel"] = sum(p.numel() for p in stage.parameters())
    out["whole_numel"] = sum(p.numel() for p in spec["build"]()["vit" if "vit" in name else "backbone"].parameters())
    if name == "vit_alias":
        out["alias_is_stage"] = module.vit.blocks is stage and module.backbone is stage
    for k in ("norm.weight", "unused.weight", "backbone.0.0.weight"):  # frozen at step 2, never used
        if k in got:
            out["moved"][k] = (got[k] - initial[k]).abs().max().item()
    return out


def unsaid_batch_dim_scenario(world_size: int) -> list[str]:
    """A time-major backbone input without batch_dim: split along time, which the loader's batch does not have."""
    from lightning_gpipe.strategy import GPipeStrategy

    module = _lightning_module(_time_major, _time_major_loss)
    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=PP)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_data("sequences"), batch_size=BATCH))
    return [str(w.message) for w in caught if str(w.message).startswith("GPipeStrategy")]


def loss_logging_scenario(world_size: int) -> str:
    """output="placeholder": a step that logs only when its output is non-zero logs on the last stage only."""
    from lightning_gpipe.strategy import GPipeStrategy

    def loss(self: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = self.backbone(self.prefix(x))
        if out.abs().sum() > 0:  # zeros on every stage but the last
            self.log("nonzero_outputs", 1.0)
        return F.mse_loss(self.head(out), y)

    module = _lightning_module(_probe, loss)
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=PP, output="placeholder"),
        max_steps=2,
    )
    try:
        trainer.fit(module, DataLoader(_data("vectors"), batch_size=BATCH))
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
            for name, m in _probe().items():
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
        elif name == "unsaid_batch_dim":
            out[name] = _guard(unsaid_batch_dim_scenario, world_size)
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
          "frozen_backbone", "counter", "time_major", "unsaid_batch_dim", "metrics_placeholder",
          "loss_logging"]  # fmt: skip
WORLD4 = ["metrics_all", "tied_frozen_unused"]


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
        blocks = sum(p.numel() for p in _vit(False)["vit"].blocks.parameters())
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
def test_a_split_along_a_dimension_the_batch_does_not_have_is_named(world2: list[dict[str, Any]]) -> None:
    """(T, N, D) with T = 5 split along dim 0 while the loader's tensors hold N = 8 samples: rank 0 says so, once."""
    warned = [w["unsaid_batch_dim"] for w in world2]
    assert not isinstance(warned[0], dict), warned[0]
    assert len(warned[0]) == 1 and warned[1] == [], warned
    assert "split into micro-batches along dim 0, of size 5" in warned[0][0] and "batch_dim" in warned[0][0]


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
    before = _make(spec).state_dict()
    after = plain_run(spec, 1).state_dict()
    assert rel_err(after["embed.weight"], before["embed.weight"]) > 1e-3
    assert torch.equal(after["unused.weight"], before["unused.weight"])
