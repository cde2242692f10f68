"""Tiny sequential models for the engine tests: plain tensors, (current, previous) tuples, integer tensors, BN."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D = 8


class Cell(nn.Module):
    """AmoebaNet-style cell: consumes (current, previous), returns (new, current)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cur, prev = x
        return torch.tanh(self.a(cur) + self.b(prev)), cur


class ToPair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 0.5


class FirstOfPair(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] + x[1]


class WithIds(nn.Module):
    """Carries integer token ids and a bool mask alongside the hidden state, as an NMT stage boundary does."""

    def __init__(self, vocab: int = 11, d: int = D) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: dict) -> dict:
        h = torch.tanh(self.proj(x["h"]) + self.embed(x["ids"]))
        return {"h": h * x["mask"].unsqueeze(-1), "ids": x["ids"], "mask": x["mask"], "tag": x["tag"]}


class StartIds(nn.Module):
    def __init__(self, vocab: int = 11, d: int = D) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)

    def forward(self, ids: torch.Tensor) -> dict:
        return {"h": self.embed(ids), "ids": ids, "mask": ids % 3 != 0, "tag": "nmt"}


class TakeH(nn.Module):
    def forward(self, x: dict) -> torch.Tensor:
        assert x["tag"] == "nmt"  # non-tensor values cross stages too
        return x["h"]


def mlp(L: int = 8, d: int = D, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(L):
        layers.append(nn.Sequential(nn.Linear(d, d), nn.Tanh()) if i % 2 == 0 else nn.Linear(d, d))
        if dropout and i % 3 == 1:
            layers[-1] = nn.Sequential(layers[-1], nn.Dropout(dropout))
    return nn.Sequential(*layers)


def cells(L: int = 8) -> nn.Sequential:
    return nn.Sequential(ToPair(), *[Cell() for _ in range(L - 2)], FirstOfPair())


def with_ids(L: int = 8) -> nn.Sequential:
    return nn.Sequential(StartIds(), *[WithIds() for _ in range(L - 2)], TakeH())


def with_bn() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh(), nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh())


MODELS = {"mlp": mlp, "cells": cells, "ids": with_ids}


def make_input(kind: str, N: int, T: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ids":
        shape = (N,) if T is None else (N, T)
        return torch.randint(0, 11, shape, generator=g)
    shape = (N, D) if T is None else (N, T, D)
    return torch.randn(shape, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class Busy(nn.Module):
    """A layer about 100x costlier than a Linear(8, 8), so that balance="time" must isolate it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat(1, 8)
        for _ in range(100):
            h = h @ self.w
        return h[:, : x.shape[1]]


class Conv(nn.Module):
    """A Conv1d over the sequence of (N, T, D) hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x.transpose(1, 2))).transpose(1, 2)


class Scale(nn.Module):
    """A parameter outside the ops zb-h1 splits: its gradient comes in I."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class OwnCheckpoint(nn.Module):
    """A bias-free linear, then a linear under the model's own non-reentrant ``torch.utils.checkpoint``, whose
    recompute (in backward, outside zb-h1's split) must save what its forward saved: it does not split."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.inner = nn.Linear(D, D, bias=False), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: torch.tanh(self.inner(t)), self.lin(x), use_reentrant=False)


def mixed(dropout: float) -> nn.Sequential:
    """The zb-h1 tests' model: an embedding, linears, a LayerNorm, a Conv1d, a custom parameter, dropout and the
    model's own checkpoint; integer ids (N, T) in."""
    return nn.Sequential(
        nn.Embedding(11, D, padding_idx=0),
        nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Dropout(dropout)),
        Conv(),
        Scale(),
        nn.Sequential(nn.Linear(D, D), nn.Dropout(dropout)),
        OwnCheckpoint(),
    )
