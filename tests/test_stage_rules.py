"""The engine's rules for real models and habits: the batch dimension, per-sample non-tensor items, layers with
state under re-materialization, indexing a stage like its nn.Sequential, and errors that say what went wrong.

Each launch of 2 processes runs several cases and returns what every rank saw; the tests assert on all ranks.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.pipe import PipelineStage, micro_batch_sizes
from lightning_gpipe.pipe.errors import PipelineError

from launch import run_distributed
from models import D

TOL = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------- models
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


class ToTimeMajor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class Returns(nn.Module):
    """Returns a scalar or None: what a backbone that computes its own loss looks like to the pipeline."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.square().mean() if self.what == "scalar" else None


class Carry(nn.Module):
    """A Linear on the tensor; the per-sample names travel alongside, and must stay with their samples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, batch: tuple[torch.Tensor, list[str]]) -> tuple[torch.Tensor, list[str]]:
        x, names = batch
        assert isinstance(names, list) and len(names) == x.shape[0], (len(names), x.shape)
        return torch.tanh(self.lin(x)), names


class Shout(nn.Module):
    def forward(self, batch: tuple[torch.Tensor, list[str]]) -> tuple[torch.Tensor, list[str]]:
        x, names = batch
        return x, [name.upper() for name in names]


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += x.shape[0]
        return x


class EMA(nn.Module):
    """Subtracts a running mean of its input, updated before use: in place, or by reassigning the buffers."""

    def __init__(self, reassign: bool) -> None:
        super().__init__()
        self.reassign = reassign
        self.register_buffer("mean", torch.zeros(D))
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_mean = x.detach().mean(0)
        if self.reassign:
            self.mean = 0.5 * self.mean + 0.5 * batch_mean
            self.updates = self.updates + 1
        else:
            self.mean.mul_(0.5).add_(0.5 * batch_mean)
            self.updates += 1
        return x - self.mean


def stateful_backbone(reassign: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh(), Counter(), EMA(reassign), nn.Linear(D, D), nn.Tanh()
    )


def six_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


# ------------------------------------------------------------------------------------------------- healthy cases
def time_major_case(mode: str) -> dict[str, float]:
    """One training step and one forward-only pass of a time-major GRU + Transformer backbone with batch_dim=1."""
    model = time_major_backbone()
    ref = copy.deepcopy(model)
    stage = PipelineStage(model, chunks=3, balance=[2, 3], checkpoint=mode, batch_dim=1, output="all")
    x, target = randn(5, 7, D), randn(5, 7, D, seed=2)  # T = 5, N = 7: micro-batches of 3, 2, 2 samples
    out = stage(x)
    F.mse_loss(out, target).backward()
    stage.backward()
    ref_out = ref(x)
    F.mse_loss(ref_out, target).backward()
    ref_params = dict(ref.named_parameters())
    errs = {name: rel_err(p.grad, ref_params[name].grad) for name, p in stage.named_parameters()}
    errs["out"] = rel_err(out.detach(), ref_out.detach())
    with torch.no_grad():
        errs["eval"] = rel_err(stage(x), ref(x))
    return errs


def strings_case() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(Carry(), Carry(), Carry(), Shout())
    ref = copy.deepcopy(model)
    stage = PipelineStage(model, chunks=3, balance=[2, 2], checkpoint="except_last", output="all")
    x, names = randn(7, D), [f"sample-{i}" for i in range(7)]
    out, shouted = stage((x, names))
    out.square().mean().backward()
    stage.backward()
    ref_out, _ = ref((x, names))
    ref_out.square().mean().backward()
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        _, evaluated = stage((x, names))
    return {
        "shouted": shouted,
        "evaluated": evaluated,
        "grad": max(rel_err(p.grad, ref_params[n].grad) for n, p in stage.named_parameters()),
    }


def stateful_case(mode: str, M: int, reassign: bool) -> dict[str, Any]:
    """Two training steps; the reference runs the plain model on the same micro-batches one after another."""
    model = stateful_backbone(reassign)
    ref = copy.deepcopy(model)
    stage = PipelineStage(model, chunks=M, balance=[3, 4], checkpoint=mode)
    ref_params = dict(ref.named_parameters())
    errs = {"grad": 0.0, "out": 0.0}
    for step, N in enumerate((8, 7)):
        x = randn(N, D, seed=step)
        ref.zero_grad()
        stage.zero_grad()
        ref_out = torch.cat([ref(mb) for mb in x.split(micro_batch_sizes(N, M))])
        ref_out.square().sum().backward()
        out = stage(x)
        if out is not None:
            out.square().sum().backward()
            errs["out"] = max(errs["out"], rel_err(out.detach(), ref_out.detach()))
        stage.backward()
        for name, p in stage.named_parameters():
            errs["grad"] = max(errs["grad"], rel_err(p.grad, ref_params[name].grad))
    state = {name: b for name, b in stage.named_buffers() if name.startswith(("3.", "4."))}
    ref_buffers = dict(ref.named_buffers())  # now: a layer that reassigns its buffers replaced them
    return {
        **errs,
        "changed": stage.buffers_changed_in_forward,
        "state": {name: b.tolist() for name, b in state.items()},
        "ref_state": {name: ref_buffers[name].tolist() for name in state},
    }


def indexing_case(rank: int) -> dict[str, Any]:
    stage = PipelineStage(six_layers(), chunks=2, balance=[3, 3])
    got: dict[str, Any] = {
        "len": len(stage),
        "holds": [stage.holds(i) for i in range(6)],
        "types": [type(stage[i]).__name__ for i in range(-6, 6)],
        "iter": [type(layer).__name__ for layer in stage],
        "same": stage[-1] is stage[5] and stage[0] is stage[0],
        "slice": list(stage[2:5].state_dict()),
        "state_dict": list(stage.state_dict()),
        "modules": [type(m).__name__ for _, m in stage.named_modules()],
    }
    for key, index in (("attr", lambda: stage[0].weight), ("out_of_range", lambda: stage[6])):
        try:
            index()
            got[key] = "no error"
        except (AttributeError, IndexError) as e:
            got[key] = f"{type(e).__name__}: {e}"
    # Per-layer learning rates, written as for the nn.Sequential: the same groups on every stage.
    opt = torch.optim.SGD([{"params": stage[i].parameters(), "lr": 0.1 * (i + 1)} for i in range(len(stage))])
    got["groups"] = [len(g["params"]) for g in opt.param_groups]
    x = randn(4, D)
    with torch.no_grad():
        stage(x)
        stage(x)
    calls = [stage.forward_only_calls]
    out = stage(x)
    if out is not None:
        out.sum().backward()
    stage.backward()
    opt.step()
    calls.append(stage.forward_only_calls)  # a training step does not count
    stage.reset()
    calls.append(stage.forward_only_calls)
    got["forward_only_calls"] = calls
    return got


def healthy_worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "time_major": {mode: time_major_case(mode) for mode in ("always", "except_last")},
        "strings": strings_case(),
        "stateful": {
            (mode, M, reassign): stateful_case(mode, M, reassign)
            for mode in ("always", "except_last")
            for M in (1, 3)
            for reassign in (False, True)
        },
        "indexing": indexing_case(rank),
    }


@pytest.fixture(scope="module")
def healthy() -> list[dict[str, Any]]:
    return run_distributed(healthy_worker, 2, timeout=200)


@pytest.mark.timeout(240)
def test_time_major_backbone_with_batch_dim_1_equals_plain_model(healthy: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(healthy):
        for mode, errs in result["time_major"].items():
            assert len(errs) > 2, errs  # every stage holds parameters
            bad = {k: v for k, v in errs.items() if v > TOL}
            assert not bad, (rank, mode, bad)


@pytest.mark.timeout(240)
def test_per_sample_strings_come_back_in_order(healthy: list[dict[str, Any]]) -> None:
    expected = [f"SAMPLE-{i}" for i in range(7)]
    for result in healthy:
        got = result["strings"]
        assert got["shouted"] == expected and got["evaluated"] == expected
        assert got["grad"] <= TOL, got["grad"]


@pytest.mark.timeout(240)
def test_recompute_does_not_change_module_state(healthy: list[dict[str, Any]]) -> None:
    """Counter and EMA buffers: M updates per step (not 2M-1 or 2M), the same values and gradients as the plain
    model run on the same micro-batches; DeferredBatchNorm's statistics are not in the list (it changes nothing in
    forward)."""
    for case, got in healthy[1]["stateful"].items():
        assert got["changed"] == ["3.count", "4.mean", "4.updates"], (case, got["changed"])
        assert got["state"]["3.count"] == 15, case  # 8 + 7 samples
        assert got["state"]["4.updates"] == 2 * case[1], case  # M per step, two steps
        for name, value in got["state"].items():
            assert value == pytest.approx(got["ref_state"][name], rel=TOL), (case, name)
        assert got["grad"] <= TOL and got["out"] <= TOL, (case, got)
    for case, got in healthy[0]["stateful"].items():
        assert got["changed"] == [], case
        assert got["grad"] <= TOL, (case, got)


@pytest.mark.timeout(240)
def test_stage_indexes_like_its_sequential(healthy: list[dict[str, Any]]) -> None:
    r0, r1 = (result["indexing"] for result in healthy)
    for r in (r0, r1):
        assert r["len"] == 6
        assert "RemoteLayer" not in r["modules"]
        assert r["same"]
        assert r["forward_only_calls"] == [2, 2, 0]
        assert "out of range" in r["out_of_range"] and "6 layers" in r["out_of_range"]
    assert r0["groups"] == [2, 0, 2, 0, 0, 0] and r1["groups"] == [0, 0, 0, 2, 0, 2]
    assert r0["holds"] == [True] * 3 + [False] * 3 and r1["holds"] == [False] * 3 + [True] * 3
    assert r0["types"] == ["Linear", "Tanh", "Linear", "RemoteLayer", "RemoteLayer", "RemoteLayer"] * 2
    assert r1["iter"] == ["RemoteLayer"] * 3 + ["Linear", "Tanh", "Linear"]
    assert r0["slice"] == ["2.weight", "2.bias"] and r1["slice"] == ["3.weight", "3.bias"]
    assert r1["state_dict"] == ["3.weight", "3.bias", "5.weight", "5.bias"]
    assert r0["attr"] == "no error"
    assert r1["attr"].startswith(
        "AttributeError: layer 0 (Linear) is on stage 0; this rank is stage 1 and holds layers 3–5"
    ), r1["attr"]


# ------------------------------------------------------------------------------------------------------ error cases
class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("cannot cost this layer")
        self.lock = threading.Lock()


def _raise(exc: BaseException) -> float:
    raise exc


def _train(stage: PipelineStage, x: Any) -> None:
    out = stage(x)
    if out is not None:
        out.square().mean().backward()
    stage.backward()


ERROR_CASES: dict[str, tuple[Callable[[], nn.Sequential], dict[str, Any], Callable[[], Any]]] = {
    # h_n is (layers, N, H): split along time (batch_dim=0 on time-major input), its dim 0 is not the samples.
    "gru_without_batch_dim": (time_major_backbone, {"balance": [2, 3]}, lambda: randn(5, 7, D)),
    "transposed": (
        lambda: nn.Sequential(ToTimeMajor(), nn.Linear(D, D), nn.Linear(D, D)),
        {"balance": [1, 2]},
        lambda: randn(6, 4, D),
    ),
    "scalar_output": (lambda: nn.Sequential(nn.Linear(D, D), Returns("scalar")), {"balance": [1, 1]}, None),
    "none_output": (lambda: nn.Sequential(nn.Linear(D, D), Returns("none")), {"balance": [1, 1]}, None),
    "balance_raises": (six_layers, {"balance": lambda i, layer: 1 / 0}, None),
    "balance_unpicklable": (six_layers, {"balance": lambda i, layer: _raise(Unpicklable())}, None),
}


def error_worker(rank: int, world_size: int) -> dict[str, str]:
    got = {}
    for name, (build, kwargs, make_input) in ERROR_CASES.items():
        # A fresh group per case: a failed pipeline may leave unreceived messages on its own.
        group = dist.new_group(backend="gloo")
        try:
            stage = PipelineStage(build(), chunks=2, group=group, timeout=20, **kwargs)
            _train(stage, make_input() if make_input else randn(4, D))
            got[name] = "no error"
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
    return got


@pytest.fixture(scope="module")
def errors() -> list[dict[str, str]]:
    return run_distributed(error_worker, 2, timeout=100)


FIX = "pass batch_dim=1 (GPipeStrategy(batch_dim=1)) for time-major (T, N, …) tensors, or return batch-first tensors"


@pytest.mark.timeout(120)
def test_time_major_tensor_without_batch_dim_is_a_clear_error_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        message = got["gru_without_batch_dim"]
        assert message.startswith("PipelineError: stage 0 failed in the forward phase (micro-batch 0)"), message
        assert "layer 1 (GRUBoth) returned a tensor of shape (1, 7, 8) at output[1]" in message, message
        assert "this micro-batch has 3 samples" in message and FIX in message, message
        message = got["transposed"]
        assert "layer 0 (ToTimeMajor) returned a tensor of shape (4, 3, 8)" in message and FIX in message, message


@pytest.mark.timeout(120)
def test_scalar_or_none_output_names_the_last_layer_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        for case, what in (("scalar_output", "a 0-dim tensor"), ("none_output", "None")):
            message = got[case]
            assert message.startswith("PipelineError: stage 1 failed in the forward phase"), message
            assert f"layer 1 (Returns), the last layer of the pipelined module, returned {what}" in message, message
            assert "must return per-sample tensors" in message and "after the backbone" in message, message


@pytest.mark.timeout(120)
def test_failing_balance_function_raises_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        assert got["balance_raises"].startswith("RuntimeError: the balance cost function"), got["balance_raises"]
        assert "ZeroDivisionError: division by zero" in got["balance_raises"]
        assert "Unpicklable: cannot cost this layer" in got["balance_unpicklable"], got["balance_unpicklable"]


# ----------------------------------------------------------------------------------------------------- a dead peer
class ExitOnStage1(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(0.5)  # stage 0 is in its end-of-phase status check by now
            os._exit(3)
        return x


def dying_peer_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), ExitOnStage1(), nn.Linear(D, D))
    stage = PipelineStage(model, chunks=2, balance=[2, 2], timeout=10)
    start = time.monotonic()
    try:
        stage(randn(4, D))
    except PipelineError as e:
        return {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
    return {"type": "none", "elapsed": time.monotonic() - start}


@pytest.mark.timeout(60)
def test_status_check_says_a_peer_died_not_that_it_waited() -> None:
    got = run_distributed(dying_peer_worker, 2, timeout=40, pg_timeout=20, expect_errors=True, allow_missing=True)[0]
    assert isinstance(got, dict), got
    assert got["type"] == "PipelineTimeout", got
    assert "lost its connection" in got["message"] and "died or exited" in got["message"], got["message"]
    assert "waited" not in got["message"], got["message"]
    assert got["elapsed"] < 5, got


# --------------------------------------------------------------------------------------------------- one process
@pytest.mark.timeout(30)
def test_bad_batch_dim_is_rejected() -> None:
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="batch_dim must be an int"):
            PipelineStage(six_layers(), batch_dim=bad)


@pytest.mark.timeout(30)
def test_0_dim_input_gets_the_gradient_of_every_micro_batch() -> None:
    """A 0-dim input (a scale) is used whole by every micro-batch: its gradient is their sum."""
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    ref = copy.deepcopy(model)
    stage = PipelineStage(nn.Sequential(Scaled(model)), chunks=3, checkpoint="always")
    x, scale, ref_scale = randn(7, D), torch.tensor(1.5, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    stage((x, scale)).square().sum().backward()
    stage.backward()
    (ref(x) * ref_scale).square().sum().backward()
    assert rel_err(scale.grad, ref_scale.grad) <= TOL


class Scaled(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, scale = batch
        return self.inner(x) * scale
