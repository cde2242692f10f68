"""GPipeStrategy's "auto" arguments: planned at setup on rank 0, the same on every rank, the plain run's weights
whatever it chose, its budget and its errors, and the check after the first steps."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from lightning_gpipe.pipe.schedule.registry import SCHEDULES
from lightning_gpipe.pipe.split.plan import Candidate, Prediction
from lightning_gpipe.strategy._auto_plan import CHECK_STEPS, PlanCheck
from tests.helpers import models
from tests.helpers.launch import run_distributed
from tests.helpers.pipeline_loss_fit import HookModule, fit
from tests.helpers.tiny_fit import BATCH, TOL, TinyPipelined


class _Example:
    """A forward and an example mini-batch: what the plan measures the backbone on."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(BATCH, models.D, generator=torch.Generator().manual_seed(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(x)))  # type: ignore[attr-defined]


class Planned(_Example, HookModule):
    """The loss inside the pipeline (its pipeline_loss hook)."""


class PlannedOutside(_Example, TinyPipelined):
    """The loss outside the pipeline (no hook): training runs GPipe's phases, whatever the plan."""


def worker(rank: int, world_size: int, kind: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(pipeline_parallel_size=world_size, save_distributed_checkpoint=False, **kwargs)
    try:
        module, _ = fit(strategy, world_size, 1, 1, None, kind)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    chosen = (strategy.schedule, strategy.chunks, strategy.virtual_stages, strategy.activation_checkpointing)
    return {
        "params": {n: p.detach().tolist() for n, p in module.named_parameters()},
        "chosen": chosen,
        "balance": strategy.stage.balance,
        "planned": strategy._plan_check.chosen is not None,
    }


AUTO = {"schedule": "auto", "chunks": "auto", "virtual_stages": "auto", "activation_checkpointing": "auto"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        (Planned, AUTO),
        (Planned, {"chunks": "auto", "schedule": "1f1b"}),  # only M left open
        (PlannedOutside, AUTO),
    ],
)
def test_an_auto_plan_is_the_same_on_every_rank_and_the_plain_run(kind: type, kwargs: dict[str, Any]) -> None:
    """Every rank runs the plan rank 0 made (a registered schedule, M, v, re-materialization, layer counts for its vK
    stages), the fixed arguments as given; the weights after the fit equal the plain Trainer's (≤ 1e-6) whatever was
    chosen; with the loss outside, training runs GPipe's phases on one chunk per rank."""
    results = run_distributed(worker, 2, kind, kwargs, timeout=280, lightning=True)
    assert all("error" not in r for r in results), results
    r0 = results[0]
    assert all(r["chosen"] == r0["chosen"] for r in results), [r["chosen"] for r in results]
    schedule, M, v, checkpoint = r0["chosen"]
    assert schedule in SCHEDULES and schedule != "fill-drain" and isinstance(M, int) and isinstance(v, int)
    assert checkpoint in ("always", "except_last", "never") and len(r0["balance"]) == 2 * v
    assert sum(r0["balance"]) == len(models.mlp()) and r0["planned"]
    for name, value in kwargs.items():
        if value != "auto":
            assert (
                dict(zip(("schedule", "chunks", "virtual_stages", "activation_checkpointing"), r0["chosen"]))[name]
                == value
            )
    if kind is PlannedOutside:
        assert (schedule, v) == ("gpipe", 1)
    warnings.simplefilter("ignore")
    plain, _ = fit("auto", 1, 1, 1, None, kind)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            ref = plain.get_parameter(name).detach()
            err = ((torch.tensor(value) - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL, (rank, name, err)


@pytest.mark.timeout(120)
def test_a_budget_nothing_fits_and_a_missing_example_fail_at_setup_on_every_rank() -> None:
    tight = run_distributed(worker, 2, Planned, {**AUTO, "max_memory_per_stage": 16}, timeout=100, lightning=True)
    for r in tight:
        assert "no candidate fits the memory budget of 0.0 MiB per rank: the leanest" in r["error"], r
    bare = run_distributed(worker, 2, HookModule, {"chunks": "auto"}, timeout=100, lightning=True)
    for r in bare:
        assert "GPipeStrategy(chunks=auto) measures the backbone on one mini-batch" in r["error"], r


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_memory_per_stage": 0}, "GPipeStrategy(max_memory_per_stage=0): the memory each rank's stage may peak"),
        ({"max_memory_per_stage": 1.5}, "GPipeStrategy(max_memory_per_stage=1.5)"),
        ({"max_memory_per_stage": True}, "GPipeStrategy(max_memory_per_stage=True)"),
        ({"chunks": "many"}, "GPipeStrategy(chunks='many'): chunks, M, must be an int ≥ 1 or 'auto'"),
        ({"schedule": "fastest"}, "GPipeStrategy(schedule='fastest'): choose one of"),
        ({"activation_checkpointing": "some"}, "GPipeStrategy(activation_checkpointing='some'): choose one of"),
    ],
)
def test_auto_arguments_are_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    from lightning_gpipe.strategy import GPipeStrategy

    with pytest.raises(ValueError) as caught:
        GPipeStrategy(**kwargs)
    assert str(caught.value).startswith(message), str(caught.value)
    GPipeStrategy(**AUTO, max_memory_per_stage=0.5)  # a fraction of the device's memory
    GPipeStrategy(**AUTO, max_memory_per_stage=2**30)  # bytes


def test_the_check_warns_after_the_timed_steps_when_the_step_misses_its_prediction() -> None:
    fast = Prediction(Candidate("gpipe", 4, 1, "except_last"), [4, 4], 1e-9, 0.1, [0, 0], actions=8)
    other = Prediction(Candidate("1f1b", 2, 1, "except_last"), [4, 4], 2e-9, 0.1, [0, 0], actions=4)
    idle = PlanCheck()
    for _ in range(10):
        idle.begin()
        idle.end()
    assert idle.times == [] and idle.message is None  # nothing planned, nothing timed
    planned = PlanCheck(fast, [fast, other])
    with pytest.warns(UserWarning, match=r"schedule='auto' chose schedule='gpipe', M=4, .* the traced steps took"):
        for _ in range(CHECK_STEPS.stop):
            planned.begin()
            planned.end()
    assert len(planned.times) == len(CHECK_STEPS) and planned.message is not None
    assert "schedule='1f1b', M=2" in planned.message  # fewer actions: the missed time was per action
