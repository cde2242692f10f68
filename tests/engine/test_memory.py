"""Re-materialization: a checkpointed micro-batch keeps only its stage-boundary input through the forward phase.

The probe counts the tensors autograd packs for backward (``saved_tensors_hooks``) while the stage's forward phase
runs: that is the activation memory a micro-batch holds until its backward. The checks then look at what the stage
retains per micro-batch through ``stage._steps`` -- private, but it is exactly the state whose size the guarantee is
about, and no public API exposes it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_gpipe.pipe.run.loss_outside import is_checkpointed
from lightning_gpipe.pipe.stage import GPipeStage
from tests.helpers.launch import run_distributed
from tests.helpers.models import loss_fn, make_input, mlp

N, M, L = 8, 4, 6  # N divisible by M: every micro-batch saves the same tensors
MODES = ("always", "except_last", "never")


def count_packs(fn: Any) -> tuple[Any, int]:
    """Run ``fn()`` and count the tensors autograd saves for backward meanwhile."""
    packs = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal packs
        packs += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, packs


def boundary_only(stage: GPipeStage, mode: str, sample_shape: tuple[int, ...]) -> None:
    """Checkpointed micro-batches hold their input (one leaf per boundary tensor) and no output."""
    micro = stage._steps[0].micro
    assert len(micro) == M
    for m, mb in enumerate(micro):
        inputs = [x for x in tree_flatten(mb.input)[0] if isinstance(x, torch.Tensor)]
        assert [tuple(x.shape) for x in inputs] == [(N // M, *sample_shape)]
        # A leaf: the boundary input carries no graph of an earlier stage's (or the caller's) computation.
        assert all(x.grad_fn is None for x in inputs)
        if is_checkpointed(mode, m, M):
            assert mb.output is None, f"micro-batch {m} kept its output"
            assert mb.state is not None  # what the recompute replays instead
        else:
            assert mb.output is not None and mb.state is None


def reference_grads(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    loss_fn(model(x), target).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["input"] = x.grad
    return grads


def train_step(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """One pipeline step; returns this stage's gradients and the packs counted during the forward phase only."""
    x = x.clone().requires_grad_()
    out, packs = count_packs(lambda: stage(x))
    boundary_only(stage, stage._executor.checkpoint, tuple(x.shape[1:]))
    if out is not None:
        loss_fn(out, target).backward()
    stage.backward()
    grads = {name: p.grad for name, p in stage.named_parameters()}
    if stage.is_first:
        grads["input"] = x.grad
    return grads, packs


def run_modes(balance: list[int]) -> dict[str, int]:
    """Every checkpoint mode on the same model and batch; checks gradients, returns the packs per mode."""
    torch.manual_seed(0)
    model = mlp(L)
    x, target = make_input("mlp", N), make_input("mlp", N, seed=1)
    expected = reference_grads(copy.deepcopy(model), x, target)
    packs = {}
    for mode in MODES:
        # A fresh copy per mode: the stage owns its layers, and their .grad must start empty.
        stage = GPipeStage(copy.deepcopy(model), chunks=M, balance=balance, checkpoint=mode)
        grads, packs[mode] = train_step(stage, x, target)
        assert grads.keys() <= expected.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
    return packs


def assert_packs(packs: dict[str, int]) -> None:
    assert packs["always"] == 0, packs
    assert packs["never"] > 0, packs  # the probe sees activations when they are kept
    assert packs["never"] % M == 0, packs
    # except_last keeps the graph of the last micro-batch only.
    assert packs["except_last"] == packs["never"] // M, packs


@pytest.mark.timeout(30)
def test_single_process_keeps_only_boundaries() -> None:
    assert_packs(run_modes([L]))


def two_stage_worker(rank: int, world_size: int) -> dict[str, int]:
    return run_modes([L // 2, L - L // 2])


@pytest.mark.timeout(60)
def test_two_stages_keep_only_boundaries() -> None:
    for packs in run_distributed(two_stage_worker, 2, timeout=45):
        assert_packs(packs)
