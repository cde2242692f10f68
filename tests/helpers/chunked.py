"""Virtual stages' parity runs: a chain of layers, its per-micro-batch loss, three optimizer steps under a schedule
against the plain model (tests/engine/test_interleaved.py, test_zb_v.py)."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.comm.nccl_order import ENV
from lightning_gpipe.pipe.dp.grads import sum_over_pipeline
from lightning_gpipe.pipe.schedule.registry import lookup
from tests.helpers import models

D = models.D
# (N, T) per step: uneven micro-batches, a new sequence length every step (the boundary shapes change).
STEPS = [(10, 3), (7, 5), (13, 2)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def chain(L: int, dtype: torch.dtype) -> nn.Sequential:
    """L layers, Linear + Tanh and plain Linear by turns, on (N, T, D) inputs."""
    torch.manual_seed(1234)
    return models.mlp(L).to(dtype)


def tied(dtype: torch.dtype) -> nn.Sequential:
    """Layer 0's weight is used again by layer 7 (chunk 3: the other rank at K = 2, v = 2) and layer 4 (chunk 2: the
    same rank as layer 0): a tie across ranks and one within a rank's virtual stages."""
    model = chain(8, dtype)
    model[7].weight = model[0][0].weight
    model[4][0].weight = model[0][0].weight
    return model


def micro_losses(target: torch.Tensor, sizes: list[int]) -> Any:
    N, offsets = sum(sizes), [sum(sizes[:m]) for m in range(len(sizes))]

    def fn(y: torch.Tensor, m: int) -> torch.Tensor:
        return models.loss_fn(y, target[offsets[m] : offsets[m] + sizes[m]]) * (sizes[m] / N)

    return fn


def parity_run(
    make: Any,
    v: int,
    M: int,
    balance: Any,
    dtype: torch.dtype,
    optimizer: str,
    mode: str,
    K: int,
    schedule: str,
    compile: dict | None = None,
) -> dict[str, Any]:
    """Three optimizer steps under ``schedule`` (its chunks placed as it needs; ``compile``: GPipeStage's) and on the
    plain model: the largest relative differences."""
    model = make(dtype)
    ref = copy.deepcopy(model)
    placement = lookup(schedule).placement
    stage = GPipeStage(model, chunks=M, balance=balance, checkpoint=mode, virtual_stages=v, placement=placement,
                       compile=compile or False)  # fmt: skip
    make_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1), "adam": lambda p: torch.optim.Adam(p, lr=0.01)}
    opt, ref_opt = make_opt[optimizer](stage.parameters()), make_opt[optimizer](ref.parameters())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    errs = {"grad": 0.0, "loss": 0.0, "weight": 0.0}
    shared = [p for _, _, p in stage.shared if p is not None]
    for step, (N, T) in enumerate(STEPS):
        x = models.make_input("mlp", N, T, seed=step).to(dtype)
        target = torch.randn(N, T, D, generator=torch.Generator().manual_seed(100 + step)).to(dtype)
        ref_opt.zero_grad()
        ref_loss = models.loss_fn(ref(x), target)
        ref_loss.backward()
        opt.zero_grad()
        losses = stage.forward_backward(
            x,
            micro_losses(target, stage.micro_batch_sizes(x)),
            schedule=schedule,  # type: ignore[arg-type]
        )
        sum_over_pipeline(shared, dist.group.WORLD)  # tied weights: each rank's part of the gradient
        if stage.is_last:
            errs["loss"] = max(errs["loss"], rel_err(torch.stack(losses).sum(), ref_loss.detach()))
        for name, p in stage.named_parameters():
            errs["grad"] = max(errs["grad"], rel_err(p.grad, ref_params[name].grad))
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref_params[name].detach()))
    return {"errs": errs, "keys": sorted(stage.state_dict()), "shared": [(n, s) for n, s, _ in stage.shared]}


def parity_worker(
    rank: int,
    world_size: int,
    v: int,
    cases: list[tuple],
    schedule: str = "interleaved-1f1b",
    ordered: bool = False,
    compile: dict | None = None,
) -> list[tuple[tuple, dict[str, Any]]]:
    warnings.simplefilter("ignore")  # N < M warns by design
    if ordered:  # NCCL's ordering rules, modelled on gloo
        os.environ[ENV] = "1"
    out = []
    for case in cases:
        make, M, balance, dtype, optimizer, mode = case
        out.append((case, parity_run(make, v, M, balance, dtype, optimizer, mode, world_size, schedule, compile)))
    return out


F64, F32 = torch.float64, torch.float32
TOLS = {F64: 1e-12, F32: 1e-6}


def batchnorm_worker(rank: int, world_size: int, schedule: str) -> dict[str, float]:
    """Deferred BatchNorm in the two chunks of both ranks, placed as ``schedule`` needs: micro-batch normalization,
    statistics committed once per step; the gradients against the largest (a bias before a BatchNorm has a
    gradient of rounding noise)."""
    torch.manual_seed(0)
    model = nn.Sequential(*models.with_bn(), *models.with_bn()).double()
    ref = copy.deepcopy(model)
    bns = [i for i, layer in enumerate(model) if isinstance(layer, nn.BatchNorm1d)]
    M = 4
    placement = lookup(schedule).placement
    stage = GPipeStage(model, chunks=M, balance=[3, 3, 3, 3], virtual_stages=2, placement=placement)
    full_bn = {i: copy.deepcopy(ref[i]) for i in bns}
    ref_params = dict(ref.named_parameters())
    errs = {"grad": 0.0, "mean": 0.0, "var": 0.0, "tracked": 0.0}
    for step, N in enumerate((10, 13)):
        x = models.make_input("mlp", N, seed=step).double()
        inputs: dict[int, list[torch.Tensor]] = {i: [] for i in bns}
        hooks = [ref[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0])) for i, got in inputs.items()]
        sizes = micro_batch_sizes(N, M)
        ref_out = torch.cat([ref(mb) for mb in x.split(sizes)])
        for h in hooks:
            h.remove()
        for i, bn in full_bn.items():
            bn(torch.cat(inputs[i]))
        tgt = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step)).double()
        ref.zero_grad()
        models.loss_fn(ref_out, tgt).backward()
        stage.zero_grad()
        stage.forward_backward(x, micro_losses(tgt, sizes), schedule=schedule)  # type: ignore[arg-type]
        scale = max(ref_params[n].grad.abs().max().item() for n, _ in stage.named_parameters())
        diffs = [(p.grad - ref_params[n].grad).abs().max().item() / scale for n, p in stage.named_parameters()]
        errs["grad"] = max([errs["grad"], *diffs])
    for name, module in stage.named_children():
        if int(name) in full_bn:
            bn = full_bn[int(name)]
            errs["mean"] = max(errs["mean"], rel_err(module.running_mean, bn.running_mean))
            errs["var"] = max(errs["var"], rel_err(module.running_var, bn.running_var))
            errs["tracked"] = max(errs["tracked"], float(int(module.num_batches_tracked) != 2))
    return errs
