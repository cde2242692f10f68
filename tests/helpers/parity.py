"""The engine's parity cases: one pipelined run against the unpartitioned model, and the checks of their errors."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from tests.helpers import models

TOL = 1e-6  # fp32, relative to the largest magnitude of the reference tensor
BALANCES = {1: [8], 2: [3, 5], 3: [3, 3, 2], 4: [2, 2, 2, 2]}
# (N, T) per step: the batch size and sequence length change every step; N=7 < M=8 runs fewer micro-batches.
SEQUENCES = [(10, 5), (7, 9), (13, 3)]
SHAPES = {"mlp": [(10, None), (7, None), (13, None)], "cells": SEQUENCES, "ids": SEQUENCES}
MODES = ("always", "except_last", "never")
MICRO = (1, 2, 4, 8)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def target(out: torch.Tensor, step: int) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + step))


def compare_grads(
    stage: GPipeStage, ref_params: dict[str, nn.Parameter], prefixes: tuple[nn.Module, nn.Module] | None, errs: dict
) -> int:
    """Fold this stage's gradient errors (and the prefix's, on stage 0) into ``errs``; how many were compared."""
    for name, p in stage.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        errs["grad"] = max(errs["grad"], rel_err(p.grad, ref_params[name].grad))
    if prefixes is not None and stage.is_first:
        for p, r in zip(prefixes[0].parameters(), prefixes[1].parameters()):
            errs["prefix"] = max(errs["prefix"], rel_err(p.grad, r.grad))
    return len(list(stage.parameters()))


def run_case(kind: str, M: int, mode: str, balance: list[int] | str, output: str, pre: bool) -> dict[str, float]:
    """Three optimizer steps, pipelined and plain; the largest relative difference of everything comparable."""
    torch.manual_seed(1234)
    backbone = models.MODELS[kind]()
    # `pre` puts a layer before the backbone, so the input needs a gradient (as an embedding before it would).
    prefix = nn.Linear(models.D, models.D) if pre else nn.Identity()
    ref_backbone, ref_prefix = copy.deepcopy(backbone), copy.deepcopy(prefix)
    stage = GPipeStage(backbone, chunks=M, balance=balance, checkpoint=mode, output=output)
    opt = torch.optim.SGD([*stage.parameters(), *prefix.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([*ref_backbone.parameters(), *ref_prefix.parameters()], lr=0.1)
    ref_params = dict(ref_backbone.named_parameters())
    errs = {"grad": 0.0, "out": 0.0, "loss": 0.0, "weight": 0.0, "prefix": 0.0, "eval": 0.0}
    checked = 0
    for step, (N, T) in enumerate(SHAPES[kind]):
        x = models.make_input(kind, N, T, seed=step)
        ref_opt.zero_grad()
        ref_out = ref_backbone(ref_prefix(x))
        tgt = target(ref_out, step)
        ref_loss = models.loss_fn(ref_out, tgt)
        ref_loss.backward()
        opt.zero_grad()
        out = stage(prefix(x))
        if out is not None:
            loss = models.loss_fn(out, tgt)
            loss.backward()
            errs["out"] = max(errs["out"], rel_err(out.detach(), ref_out.detach()))
            errs["loss"] = max(errs["loss"], rel_err(loss.detach(), ref_loss.detach()))
        stage.backward()
        checked += compare_grads(stage, ref_params, (prefix, ref_prefix) if pre else None, errs)
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref_params[name].detach()))
    with torch.no_grad():
        x = models.make_input(kind, 9, SHAPES[kind][0][1], seed=99)
        out = stage(prefix(x))
        if out is not None:
            errs["eval"] = rel_err(out, ref_backbone(ref_prefix(x)))
    errs["params_checked"] = checked
    return errs


def check_cases(per_rank: list[list[tuple[tuple, dict[str, float]]]]) -> int:
    """Assert every case's errors ≤ TOL on every stage; returns how many parameters were compared."""
    checked = 0
    for rank, results in enumerate(per_rank):
        for case, errs in results:
            checked += int(errs.pop("params_checked"))
            bad = {k: v for k, v in errs.items() if v > TOL}
            assert not bad, f"stage {rank}, case {case}: {bad}"
    return checked


def compare_running_stats(stage: GPipeStage, full_bn: dict[int, nn.Module], errs: dict) -> None:
    """Fold the errors of this stage's running statistics against whole-batch BatchNorms (after 2 steps) into errs."""
    for name, module in stage.named_children():
        if int(name) in full_bn:
            bn = full_bn[int(name)]
            errs["mean"] = max(errs["mean"], rel_err(module.running_mean, bn.running_mean))
            errs["var"] = max(errs["var"], rel_err(module.running_var, bn.running_var))
            errs["tracked"] = float(int(module.num_batches_tracked) != 2)
