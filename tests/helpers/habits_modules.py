"""The modules and the plain reference of test_habits: timm models as their users plug them in, a tied LM, probes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests.helpers import models

PP = 2
BATCH, STEPS, LR = 8, 4, 0.05
V = 11  # vocabulary of the tied language model
EVAL = 24


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_err(got, want) if got.is_floating_point() else float(not torch.equal(got, want))


# ------------------------------------------------------------------------------------------------------ modules
def habit_module(
    build: Callable[[], dict[str, nn.Module]],
    loss: Callable,
    opt: str = "sgd",
    backbone: str = "vit.blocks",
    **hooks: Any,
):
    """A LightningModule holding ``build()``'s submodules; ``loss(self, batch)`` is its training loss, or with hooks
    ``features`` and ``head`` the loss is ``self.pipeline_loss(backbone(features(self, x)), batch)`` (``backbone``:
    the submodule's dotted path), which GPipeStrategy runs inside the pipeline (``loss`` stays the plain run's)."""
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
                value = self.pipeline_loss(self.get_submodule(backbone)(hooks["features"](self, batch[0])), batch)
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


def vit_parts(alias: bool) -> dict[str, nn.Module]:
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
    modules = probe_parts()
    modules["backbone"] = nn.Sequential(*modules["backbone"][:4], Counter(), *modules["backbone"][4:])
    return modules


def _counting_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(self.head(self.backbone(self.prefix(x))), y)


def time_major_parts() -> dict[str, nn.Module]:
    layers = [nn.TransformerEncoderLayer(models.D, 2, 16, dropout=0.0) for _ in range(4)]  # (T, N, D) by default
    return {"backbone": nn.Sequential(*layers), "head": nn.Linear(models.D, 5)}


def time_major_loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch  # (N, T, D) from the loader; the backbone takes (T, N, D)
    return F.cross_entropy(self.head(self.backbone(x.transpose(0, 1)).mean(0)), y)


def probe_parts() -> dict[str, nn.Module]:
    return {"prefix": nn.Linear(models.D, models.D), "backbone": models.mlp(), "head": nn.Linear(models.D, models.D)}


SCENARIOS: dict[str, dict[str, Any]] = {
    # Uneven: the alias used to keep the whole backbone, and an uneven split then died in a gloo size mismatch.
    "vit_alias": {"build": lambda: vit_parts(alias=True), "loss": _vit_loss, "data": "images", "balance": [1, 3]},
    "vit_dotted": {"build": lambda: vit_parts(alias=False), "loss": _vit_loss, "data": "images", "path": "vit.blocks"},
    # The same ViT with its head and loss in pipeline_loss, run per micro-batch on the last stage (N = 8, M = 3).
    "vit_inside": {
        "build": lambda: vit_parts(alias=False),
        "loss": _vit_loss,
        "data": "images",
        "path": "vit.blocks",
        "chunks": 3,
        "hooks": {"features": _vit_features, "head": _vit_head},
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
    "frozen_backbone": {"build": probe_parts, "loss": _frozen_backbone_loss, "data": "vectors"},
    # nn.TransformerEncoderLayer's default layout: the samples are dim 1, and the strategy is told so.
    "time_major": {"build": time_major_parts, "loss": time_major_loss, "data": "sequences", "batch_dim": 1},
    # Counted once per micro-batch, never again in the recompute: N per step, as on one device.
    "counter": {"build": _counting, "loss": _counting_loss, "data": "vectors"},
}
# The ViT with the loss inside, its batches loaded on stage 0 only and sent to stage 1.
SCENARIOS["vit_fed"] = {**SCENARIOS["vit_inside"], "data_loading": "first_stage"}
# Each replica holding a shard of its stage.
SCENARIOS["fsdp_tied_frozen_unused"] = {**SCENARIOS["tied_frozen_unused"], "data_parallel": "fsdp"}
SCENARIOS["fsdp_vit_inside"] = {**SCENARIOS["vit_inside"], "data_parallel": "fsdp"}


def scenario_data(kind: str, n: int = 64) -> TensorDataset:  # 4 steps of 8 on each of 2 replicas
    g = torch.Generator().manual_seed(0)
    if kind in ("images", "images32"):
        side = 32 if kind == "images32" else 16
        return TensorDataset(torch.randn(n, 3, side, side, generator=g), torch.randint(0, 5, (n,), generator=g))
    if kind == "sequences":
        return TensorDataset(torch.randn(n, 5, models.D, generator=g), torch.randint(0, 5, (n,), generator=g))
    if kind == "tokens":
        return TensorDataset(torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g))
    return TensorDataset(torch.randn(n, models.D, generator=g), torch.randn(n, models.D, generator=g))


def make_module(spec: dict[str, Any]) -> Any:
    return habit_module(
        spec["build"], spec["loss"], spec.get("opt", "sgd"), spec.get("path", "vit.blocks"), **spec.get("hooks", {})
    )


def plain_run(spec: dict[str, Any], dp: int) -> Any:
    """The module trained without any strategy: each step averages the dp replicas' shards (DistributedSampler)."""
    module = make_module(spec)
    module.train()
    opt = module.configure_optimizers()
    data = scenario_data(spec["data"])
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
