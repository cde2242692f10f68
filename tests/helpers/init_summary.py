"""Initial weights compared across builds: a digest and the moments of each tensor, and draws of one distribution."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn

# How GPipeStrategy's warning about tensors it could not initialize as the model does begins.
MARK = "GPipeStrategy built the model on the meta device"


def summary(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Per tensor: a digest of its exact bytes, and its moments (for comparing draws of one distribution)."""
    out = {}
    for k, v in module.state_dict().items():
        v = v.detach().cpu()
        f = v.double()
        out[k] = {
            "sha": hashlib.sha1(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
            "numel": v.numel(),
            "mean": f.mean().item(),
            "std": f.std().item() if v.numel() > 1 else 0.0,
            "max": f.abs().max().item(),
        }
    return out


def assert_same_distribution(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    n, std = want["numel"], want["std"]
    # 6 standard errors of the sample std (≈ std / sqrt(2n)) and of the mean (std / sqrt(n)).
    assert abs(got["std"] - std) <= 6 * std / math.sqrt(2 * n) + 1e-12, (name, got, want)
    assert abs(got["mean"] - want["mean"]) <= 6 * std * math.sqrt(2 / n) + 1e-12, (name, got, want)
