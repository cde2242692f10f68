"""The U-Net of docs/guide.md's section "Long skip connections", built from the guide's own code block."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from tests.helpers import ROOT

GUIDE = ROOT / "docs" / "guide.md"


def guide_unet() -> Any:
    """The ``unet`` function of the guide's section "Long skip connections", run as the guide shows it."""
    text = GUIDE.read_text()
    section = text[text.index("### Long skip connections") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the guide's skip section has its code block"
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), str(GUIDE), "exec"), scope)
    return scope["unet"]


def make(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return guide_unet()().to(dtype)


def images(N: int, H: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, H, H, generator=g, dtype=dtype), torch.randn(N, 3, H, H, generator=g, dtype=dtype)


def run_step(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor, path: str) -> torch.Tensor | None:
    """One training step's forward and backward through ``stage`` on ``path``; the loss on the last stage."""
    if path == "outside":
        y = stage(x)
        if stage.is_last:
            loss = nn.functional.mse_loss(y, target)
            loss.backward()
            stage.backward()
            return loss.detach()
        stage.backward()
        return None
    sizes = stage.micro_batch_sizes(x)
    offsets = [sum(sizes[:m]) for m in range(len(sizes))]

    def loss_fn(y: torch.Tensor, m: int) -> torch.Tensor:
        t = target[offsets[m] : offsets[m] + sizes[m]]
        return nn.functional.mse_loss(y, t) * (sizes[m] / len(target))

    losses = stage.forward_backward(x, loss_fn, schedule=path)  # type: ignore[arg-type]
    return torch.stack(losses).sum() if stage.is_last else None
