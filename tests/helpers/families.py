"""Model families as their users build them (timm's factory, torchvision's constructors), tiny, for the fit tests."""

from __future__ import annotations

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
