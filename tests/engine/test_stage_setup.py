"""Building a stage: every rank agrees on the split, and bad arguments fail on every rank before any work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from tests.helpers import models
from tests.helpers.launch import run_distributed


def _error(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def setup_worker(rank: int, world_size: int) -> dict[str, object]:
    timed = nn.Sequential(models.Busy(), *[nn.Linear(8, 8) for _ in range(5)])
    out: dict[str, object] = {
        # Profiled timings differ per process; the split must not.
        "time": GPipeStage(timed, balance="time", sample=torch.randn(4, 8)).balance,
        "cost_fn": GPipeStage(models.mlp(), balance=lambda i, layer: 10.0 if i == 7 else 1.0).balance,
        "sum": _error(lambda: GPipeStage(models.mlp(), balance=[3, 4])),
        "length": _error(lambda: GPipeStage(models.mlp(), balance=[8])),
        "too_many_stages": _error(lambda: GPipeStage(nn.Sequential(nn.Linear(2, 2)))),
        "not_sequential": _error(lambda: GPipeStage(nn.ModuleList([nn.Linear(2, 2)]))),
        "chunks": _error(lambda: GPipeStage(models.mlp(), chunks=0)),
        "mode": _error(lambda: GPipeStage(models.mlp(), checkpoint="sometimes")),
    }
    # Last: a grad-mode mismatch breaks the pipeline for good.
    stage = GPipeStage(models.mlp(), chunks=2, timeout=20)
    x = torch.randn(4, models.D)
    try:
        if rank == 0:
            stage(x)
        else:
            with torch.no_grad():
                stage(x)
        out["grad_mode"] = "no error"
    except Exception as e:
        out["grad_mode"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(120)
def test_every_rank_agrees_and_rejects_bad_arguments_alike() -> None:
    results = run_distributed(setup_worker, 2, timeout=100)
    r0, r1 = results
    for key in ("time", "cost_fn", "sum", "length", "too_many_stages", "not_sequential", "chunks", "mode"):
        assert r0[key] == r1[key], (key, r0[key], r1[key])
    assert r0["time"] == [1, 5], r0["time"]
    assert r0["cost_fn"] == [7, 1], r0["cost_fn"]
    assert "sums to 7" in r0["sum"] and "8 layers" in r0["sum"], r0["sum"]
    assert "2" in r0["length"] and "1" in r0["length"], r0["length"]
    assert "1 layers into 2 stages" in r0["too_many_stages"], r0["too_many_stages"]
    assert r0["not_sequential"].startswith("TypeError") and "ModuleList" in r0["not_sequential"]
    assert "chunks" in r0["chunks"] and "0" in r0["chunks"]
    assert "sometimes" in r0["mode"] and "except_last" in r0["mode"]
    for r in results:
        assert "PipelineError" in r["grad_mode"] and "same grad mode" in r["grad_mode"], r["grad_mode"]


def test_single_process_without_torch_distributed() -> None:
    """K = 1 needs no process group: the engine runs (micro-batched, re-materialized) in one plain process."""
    torch.manual_seed(0)
    model = models.cells()
    ref = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(6, models.D)
    stage = GPipeStage(model, chunks=3, checkpoint="always")
    assert stage.num_stages == 1 and stage.is_first and stage.is_last
    out = stage(x)
    out.square().mean().backward()
    stage.backward()
    plain = models.cells()
    for p, r in zip(plain.parameters(), ref):
        p.data.copy_(r)
    plain(x).square().mean().backward()
    for p, q in zip(stage.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
