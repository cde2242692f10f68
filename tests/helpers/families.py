"""Model families as their users build them (timm's factory, torchvision's constructors), tiny, for the fit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _timm(name: str, **kwargs: Any) -> dict[str, nn.Module]:
    import timm

    return {"model": timm.create_model(name, pretrained=False, num_classes=5, **kwargs)}


def _mixer() -> dict[str, nn.Module]:
    from timm.models.mlp_mixer import MlpMixer  # its registered sizes fix the patch size

    return {"model": MlpMixer(num_classes=5, img_size=32, patch_size=8, num_blocks=4, embed_dim=16)}


def _torchvision() -> dict[str, nn.Module]:
    import torchvision

    # No dropout in the head: the plain run draws without a DataLoader, which takes a seed from the global stream.
    return {"model": torchvision.models.mobilenet_v3_small(num_classes=5, width_mult=0.25, dropout=0.0)}


def _loss(self: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(self.model(x.double()), y)


def family_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative to the tensor's scale, at least 1e-3: a running mean that is zero up to rounding (after a layer whose
    output has zero mean) would otherwise compare its rounding noise with itself."""
    if not got.is_floating_point():
        return float(not torch.equal(got, want))
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()


# The backbone is the model's own nn.Sequential of stages or blocks, named by its dotted path: the model's forward
# calls it, so the user's code is the library's. BatchNorm families run M = 1, where GPipe's micro-batch statistics
# equal the whole batch's (M > 1 is GPipe's semantics: tests/engine/test_batchnorm*.py).
FAMILIES: dict[str, dict[str, Any]] = {
    "timm_convnext": {
        "build": lambda: _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32)),
        "path": "model.stages",
    },
    "timm_swin": {
        "build": lambda: _timm(
            "swin_tiny_patch4_window7_224",
            img_size=32,
            patch_size=4,
            window_size=4,
            embed_dim=16,
            depths=(1, 1),
            num_heads=(1, 2),
            drop_path_rate=0.0,  # its default 0.1 draws per layout-independent seeds, not the plain run's stream
        ),
        "path": "model.layers",
    },
    "timm_mixer": {"build": _mixer, "path": "model.blocks"},
    "timm_mobilenetv3": {"build": lambda: _timm("mobilenetv3_small_050"), "path": "model.blocks", "chunks": 1},
    "torchvision_mobilenetv3": {"build": _torchvision, "path": "model.features", "chunks": 1},
}
# In float64: equal up to its rounding tells a real difference from fp32's summation order over a few SGD steps.
for _spec in FAMILIES.values():
    _spec.update(
        build=lambda build=_spec["build"]: {k: m.double() for k, m in build().items()}, loss=_loss, data="images32"
    )


# Each family split around its backbone as its library's forward runs it (features → backbone → head), so that the loss
# runs inside the pipeline, per micro-batch, which zb-h1 and interleaving need; tests/strategy/test_family_schedules.py
# checks that head(backbone(features(x))) is the model's forward, bit for bit.
_FEATURES: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "timm_convnext": lambda m, x: m.stem(x),
    "timm_swin": lambda m, x: m.patch_embed(x),
    "timm_mixer": lambda m, x: m.stem(x),
    "timm_mobilenetv3": lambda m, x: m.bn1(m.conv_stem(x)),
    "torchvision_mobilenetv3": lambda m, x: x,
}
_HEADS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "timm_convnext": lambda m, out: m.forward_head(m.norm_pre(out)),
    "timm_swin": lambda m, out: m.forward_head(m.norm(out)),
    "timm_mixer": lambda m, out: m.forward_head(m.norm(out)),
    "timm_mobilenetv3": lambda m, out: m.forward_head(out),
    "torchvision_mobilenetv3": lambda m, out: m.classifier(torch.flatten(m.avgpool(out), 1)),
}


def split_forward(name: str) -> tuple[Callable, Callable]:
    """Family ``name``'s forward before its backbone and after it, on the model: (features(m, x), head(m, out))."""
    return _FEATURES[name], _HEADS[name]


def _inside(name: str) -> dict[str, Any]:
    features, head = split_forward(name)
    return {
        "features": lambda self, x: features(self.model, x.double()),
        "head": lambda self, out, batch: F.cross_entropy(head(self.model, out), batch[1]),
    }


# The same families with the loss inside the pipeline (the plain run's loss is still the whole model's forward).
INSIDE: dict[str, dict[str, Any]] = {name: {**spec, "hooks": _inside(name)} for name, spec in FAMILIES.items()}
