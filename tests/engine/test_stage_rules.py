"""The engine's rules for real models and habits: the batch dimension, per-sample non-tensor items, layers with
state under re-materialization, and indexing a stage like its nn.Sequential (the errors: test_stage_errors.py).

One launch of 2 processes runs every case and returns what each rank saw; the tests assert on all ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from tests.helpers.launch import run_distributed
from tests.helpers.models import D
from tests.helpers.stage_models import TOL, attention_grads, randn, rel_err, six_layers, time_major_backbone

# ----------------------------------------------------------------------------------------------------------- models


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


# ------------------------------------------------------------------------------------------------- healthy cases
def time_major_case(mode: str) -> dict[str, float]:
    """One training step and one forward-only pass of a time-major GRU + Transformer backbone with batch_dim=1."""
    model = time_major_backbone()
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=3, balance=[2, 3], checkpoint=mode, batch_dim=1, output="all")
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
    stage = GPipeStage(model, chunks=3, balance=[2, 2], checkpoint="except_last", output="all")
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
    stage = GPipeStage(model, chunks=M, balance=[3, 4], checkpoint=mode)
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
    stage = GPipeStage(six_layers(), chunks=2, balance=[3, 3])
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


def test_recompute_repeats_the_forward_of_attention_with_dropout() -> None:
    """Dropout inside attention: the recomputed micro-batches (checkpoint="always") give the gradients of the kept
    graphs ("never"), bit for bit -- the recompute runs the same kernels and draws the same masks. On a GPU the
    kernel depends on the grad mode: ``tests/strategy/test_cuda.py`` runs the same check there."""
    never, always = attention_grads("never", "cpu"), attention_grads("always", "cpu")
    assert never.keys() == always.keys() and len(never) > 4
    for name in never:
        assert torch.equal(never[name], always[name]), name


def test_the_accelerators_first_forward_keeps_nothing_and_repeats_on_the_cpu_too(monkeypatch: Any) -> None:
    """What GPUs run for a checkpointed forward (grad enabled, nothing saved), forced on the CPU: the same gradients
    as the kept graphs, and the graph it builds holds no tensor, so back-propagating it fails loudly."""
    import lightning_gpipe.pipe.run.executor as schedule_module
    from lightning_gpipe.pipe.state.rematerialize import discarded_graph

    monkeypatch.setattr(schedule_module, "first_forward", lambda device, compiled=False: discarded_graph())
    never, always = attention_grads("never", "cpu"), attention_grads("always", "cpu")
    for name in never:
        assert torch.equal(never[name], always[name]), name
    w = torch.randn(3, 3, requires_grad=True)
    with discarded_graph():
        y = (torch.randn(2, 3) @ w).tanh()
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="is recomputed"):
        y.sum().backward()
