"""BatchNorm subclasses with their own forward (timm's BatchNormAct2d, a user's _BatchNorm) keep it when deferred."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.state.batchnorm import (
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    deferred_statistics,
)
from tests.helpers.launch import run_distributed

pytestmark = pytest.mark.timeout(200)

TOL = 1e-6  # fp32, relative to the largest magnitude of the reference tensor
SIZES = (10, 7)  # one step each; 7 splits unevenly


class GatedBatchNorm(_BatchNorm):
    """A user's BatchNorm straight from _BatchNorm: its own forward, with a cumulative average (momentum=None)
    and a gate after the normalization."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        assert input.dim() == 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0
        if self.training:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked)
        y = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor, self.eps
        )
        return y * torch.sigmoid(y)


class ShiftedBatchNorm2d(nn.BatchNorm2d):
    """A user's BatchNorm2d that normalizes something else than its input: the statistics are of x², not of x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.square()) + 1.0


class AtenBatchNorm2d(nn.BatchNorm2d):
    """Calls torch.batch_norm, below F.batch_norm, itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b, mean, var = self.weight, self.bias, self.running_mean, self.running_var
        return torch.batch_norm(x, w, b, mean, var, self.training, self.momentum, self.eps, False).tanh()


class ManualBatchNorm2d(nn.BatchNorm2d):
    """Updates its running mean by hand: nothing can defer that."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean((0, 2, 3)), 0.1)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


def backbone() -> nn.Sequential:
    from timm.layers import BatchNormAct2d
    from timm.models._efficientnet_blocks import DepthwiseSeparableConv

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        BatchNormAct2d(8, act_layer=nn.ReLU),
        DepthwiseSeparableConv(8, 8, act_layer=nn.SiLU),  # two BatchNormAct2d inside, the second without activation
        GatedBatchNorm(8, momentum=None),
        nn.Conv2d(8, 8, 3, padding=1),
        ShiftedBatchNorm2d(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    with torch.no_grad():  # away from weight 1, bias 0, where a dropped affine or activation could hide
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return 2.0 + torch.randn(n, 3, 5, 5, generator=g), torch.randn(n, 4, generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def norms(module: nn.Module) -> dict[str, _BatchNorm]:
    return {name: m for name, m in module.named_modules() if isinstance(m, _BatchNorm)}


def reference_step(
    ref: nn.Sequential, full: dict[str, _BatchNorm], x: torch.Tensor, t: torch.Tensor, M: int
) -> torch.Tensor:
    """GPipe's step on one process: each micro-batch through the model alone (its own batch statistics), and the
    running statistics of each BatchNorm as its own forward gives them on the whole mini-batch at once (``full``)."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    layers = norms(ref)
    hooks = [
        layers[name].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0].detach().clone()))
        for name, got in inputs.items()
    ]
    out = torch.cat([ref(mb) for mb in x.split(micro_batch_sizes(len(x), M))])
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for name, bn in full.items():
            bn(torch.cat(inputs[name]))
    ref.zero_grad()
    F.mse_loss(out, t).backward()
    return out.detach()


def run_case(M: int, mode: str) -> dict[str, Any]:
    model = backbone()
    ref = copy.deepcopy(model)
    full = {name: copy.deepcopy(bn) for name, bn in norms(ref).items()}
    before = {name: (type(m), m) for name, m in model.named_modules()}
    stage = GPipeStage(model, chunks=M, balance=[3, 6], checkpoint=mode, output="all", timeout=60)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    errs = {"out": 0.0, "grad": 0.0, "weight": 0.0, "mean": 0.0, "var": 0.0, "tracked": 0.0, "eval": 0.0}
    for step, n in enumerate(SIZES):
        x, t = data(step, n)
        ref_out = reference_step(ref, full, x, t, M)
        opt.zero_grad()
        out = stage(x)
        F.mse_loss(out, t).backward()
        stage.backward()
        errs["out"] = max(errs["out"], rel_err(out.detach(), ref_out))
        for name, p in stage.named_parameters():
            errs["grad"] = max(errs["grad"], rel_err(p.grad, ref_params[name].grad))
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref_params[name].detach()))
    mine = norms(stage)
    for name, bn in mine.items():
        errs["mean"] = max(errs["mean"], rel_err(bn.running_mean, full[name].running_mean))
        errs["var"] = max(errs["var"], rel_err(bn.running_var, full[name].running_var))
        errs["tracked"] += float(int(bn.num_batches_tracked) != int(full[name].num_batches_tracked))
    # The layers themselves, class and object, under their own names: a reference held elsewhere still holds them.
    kept = all(before[name] == (type(m), m) for name, m in stage.named_modules() if name)
    stage.eval()
    ref.eval()
    for name, bn in norms(ref).items():
        for buffer_name, buffer in full[name].named_buffers():  # not the weights: `full` never trained them
            bn.get_buffer(buffer_name).copy_(buffer)
    with torch.no_grad():
        x, _ = data(99, 9)
        errs["eval"] = rel_err(stage(x), ref(x))
    return {"errs": errs, "kept": kept, "norms": sorted(mine)}


def manual_case(deferred: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), ManualBatchNorm2d(4), nn.Flatten(), nn.Linear(100, 4))
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=1, balance=[2, 2], deferred_batch_norm=deferred, output="all", timeout=60)
    x, t = data(0, 6)
    try:
        F.mse_loss(stage(x), t).backward()
        stage.backward()
    except Exception as e:  # every stage raises: the failing stage's error reaches them all
        return {"error": str(e)}
    F.mse_loss(ref(x), t).backward()
    ref_params = dict(ref.named_parameters())
    errs = [rel_err(p.grad, ref_params[n].grad) for n, p in stage.named_parameters()]
    if stage.is_first:
        errs.append(rel_err(stage[1].running_mean, ref[1].running_mean))
    return {"error": None, "err": max(errs)}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    cases = {f"M={M} {mode}": run_case(M, mode) for M, mode in ((1, "except_last"), (3, "always"), (2, "never"))}
    off = manual_case(False)
    return {"cases": cases, "manual_off": off, "manual": manual_case(True)}  # last: a failure ends the pipeline


def test_subclasses_keep_their_forward_in_the_pipeline() -> None:
    """K=2: timm's BatchNormAct2d (alone and inside a timm block), a _BatchNorm with its own forward, a BatchNorm2d
    that normalizes a transform of its input. At M=1 the plain run; at M>1 GPipe's (each micro-batch normalized
    alone), with the running statistics and num_batches_tracked of the layer's own forward on the whole mini-batch."""
    for rank, result in enumerate(run_distributed(worker, 2, timeout=180)):
        for case, got in result["cases"].items():
            bad = {k: v for k, v in got["errs"].items() if v > TOL}
            assert not bad, (rank, case, bad)
            assert got["kept"], (rank, case)
            assert got["norms"] == (["1", "2.bn1", "2.bn2"] if rank == 0 else ["3", "5"]), (rank, case)
        error = result["manual"]["error"]
        assert error is not None and "ManualBatchNorm2d" in error and "deferred_batch_norm=False" in error, error
        assert result["manual_off"] == {"error": None, "err": pytest.approx(0.0, abs=TOL)}, result["manual_off"]


def test_outside_a_pipeline_the_layer_is_itself() -> None:
    """Deferred in place, a layer run outside a pipeline's forward phase is the layer as written, bit for bit."""
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    for make in (
        lambda: BatchNormAct2d(8, act_layer=nn.GELU),
        lambda: GatedBatchNorm(8, momentum=None),
        lambda: AtenBatchNorm2d(8),
    ):
        plain, deferred = make(), convert_deferred_batch_norm(make())
        deferred.load_state_dict(plain.state_dict())
        for _ in range(2):
            x = torch.randn(6, 8, 3, 3)
            torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=0)
        with deferred_statistics():
            outputs = [deferred(m) for m in x.tensor_split(3)]
        commit_deferred_batch_norm(deferred)
        plain(x)
        for name, buffer in plain.named_buffers():
            torch.testing.assert_close(deferred.get_buffer(name), buffer, rtol=1e-6, atol=0)
        expected = [make() for _ in range(3)]
        for e, m, out in zip(expected, x.tensor_split(3), outputs):
            e.load_state_dict(plain.state_dict())
            torch.testing.assert_close(out, e(m), rtol=1e-6, atol=1e-6)
