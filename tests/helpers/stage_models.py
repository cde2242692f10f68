"""Backbones and comparisons shared by the engine's rule and error tests: time-major, six layers, rel_err."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.models import D

TOL = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class GRUBoth(nn.Module):
    """nn.GRU as it comes, time-major: (output (T, N, H), h_n (layers, N, H)); both cross the stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(x)


class UseBoth(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out, h = pair
        return out + h[-1]


def time_major_backbone() -> nn.Sequential:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=16, dropout=0.0)  # batch_first=False
    return nn.Sequential(nn.Linear(D, D), GRUBoth(), UseBoth(), encoder, nn.Linear(D, D))


def six_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


def attention_grads(checkpoint: str, device: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Gradients of a K = 1 pipeline of two batch-first attention layers with dropout (0.3, inside
    scaled_dot_product_attention too), M = 3; equal for every ``checkpoint`` only if each recompute repeats its
    forward's kernels and dropout masks."""
    from lightning_gpipe.pipe import GPipeStage

    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(64, 4, 128, dropout=0.3, batch_first=True) for _ in range(2)]
    stage = GPipeStage(nn.Sequential(*layers).to(device), chunks=3, checkpoint=checkpoint, device=device)  # type: ignore[arg-type]
    x = torch.randn(6, 16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(2)
    with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
        out = stage(x)
    out.float().square().mean().backward()
    stage.backward()
    return {name: p.grad.detach().float().clone() for name, p in stage.named_parameters() if p.grad is not None}
