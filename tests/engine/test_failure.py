"""A failure anywhere in the pipeline raises PipelineError on every rank, naming the failing stage -- never a hang.

Each case is its own launch of 3 processes: a pipeline that failed cannot be reused. Every rank's worker returns what
happened to it, so the assertions run in the test process and see all ranks at once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.comm.nccl_order import ENV
from lightning_gpipe.pipe.errors import PipelineError
from lightning_gpipe.pipe.stage import GPipeStage
from tests.helpers.launch import run_distributed
from tests.helpers.models import D, loss_fn, make_input

K, N, M = 3, 8, 4
# Every stage ends with a Boom; only the one on the rank chosen to fail raises.
BALANCE = [3, 3, 2]
# Long enough never to fire in a case that propagates properly (so that a propagation relying on the timeout shows
# up as a slow failure), short enough that a hang fails the test instead of blocking it.
STAGE_TIMEOUT_S = 10.0
PROPAGATION_LIMIT_S = 8.0


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in backward")


class Boom(nn.Module):
    """Identity, except on rank ``stage``: raises in the forward of micro-batch ``micro_batch`` or in any backward.

    On stage 0 it can also slow every micro-batch down, so that stage 0 is still busy with its forward when a later
    stage fails: then the error must wait for stage 0 instead of being lost with the failing process.
    """

    def __init__(self, stage: int, micro_batch: int, where: str, slow_first: bool = False) -> None:
        super().__init__()
        self.stage, self.micro_batch, self.where, self.slow_first = stage, micro_batch, where, slow_first
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_first and dist.get_rank() == 0:
            time.sleep(0.3)
        if dist.get_rank() != self.stage:
            return x
        if self.where == "backward":
            return _FailInBackward.apply(x)
        if self.where == "forward":
            m, self.calls = self.calls, self.calls + 1
            if m == self.micro_batch:
                raise ValueError("boom")
        return x


@dataclass(frozen=True)
class Case:
    run: str  # which step the workers run, see RUNS
    fail_stage: int = 1
    where: str = "none"  # what Boom does: "forward", "backward" or "none" (the failure comes from elsewhere)
    output: str = "last"
    checkpoint: str = "except_last"
    slow_first: bool = False
    nccl: bool = False  # under NCCL's ordering rules (nccl_order): the link groups, each queue in posting order


def boom_model(case: Case) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model
    boom = [Boom(case.fail_stage, micro_batch=1, where=case.where, slow_first=case.slow_first) for _ in range(K)]
    return nn.Sequential(
        nn.Linear(D, D), nn.Tanh(), boom[0], nn.Linear(D, D), nn.Tanh(), boom[1], nn.Linear(D, D), boom[2]
    )


def train_step(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor) -> None:
    out = stage(x)
    if out is not None:
        loss_fn(out, target).backward()
    stage.backward()


def evaluate(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor) -> None:
    with torch.no_grad():
        stage(x)


def abort_in_loss(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor) -> None:
    # The last stage's loss fails after the forward phase; the others are already waiting in the backward phase.
    out = stage(x)
    if stage.is_last:
        stage.abort(ValueError(f"loss is {out.sum() * float('nan')}"))
    stage.backward()


def abort_before_forward(stage: GPipeStage, x: torch.Tensor, target: torch.Tensor) -> None:
    # Stage 0 fails while preparing its batch; the others are already waiting for micro-batch 0.
    if stage.is_first:
        stage.abort(ValueError("bad batch"))
    train_step(stage, x, target)


RUNS = {"train": train_step, "evaluate": evaluate, "abort_in_loss": abort_in_loss, "abort_first": abort_before_forward}


def raised(e: PipelineError, start: float) -> dict[str, Any]:
    return {"outcome": "raised", "type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}


def call_again(stage: GPipeStage, x: torch.Tensor) -> str:
    """What a second call of a failed stage says: it must refuse at once, without touching the process group."""
    try:
        stage(x)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def failing_worker(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    if case.nccl:
        os.environ[ENV] = "1"
    stage = GPipeStage(
        boom_model(case),
        chunks=M,
        balance=BALANCE,
        checkpoint=case.checkpoint,
        output=case.output,
        timeout=STAGE_TIMEOUT_S,
    )
    x, target = make_input("mlp", N), make_input("mlp", N, seed=1)
    start = time.monotonic()
    try:
        RUNS[case.run](stage, x, target)
    except PipelineError as e:
        return raised(e, start) | {"again": call_again(stage, x)}
    return {"outcome": "returned", "elapsed": time.monotonic() - start}


def assert_every_rank_raised(results: list[Any], expected: str) -> None:
    for rank, result in enumerate(results):
        assert isinstance(result, dict), f"rank {rank} crashed instead of raising PipelineError:\n{result}"
        assert result["outcome"] == "raised", f"rank {rank} returned normally from a failed step: {result}"
        assert result["type"] == "PipelineError", f"rank {rank}: {result}"  # not a timeout: it was propagated
        assert expected in result["message"], f"rank {rank}: {result['message']}"
        assert result["elapsed"] < PROPAGATION_LIMIT_S, f"rank {rank} took {result['elapsed']:.1f} s"
        assert result["again"].startswith("RuntimeError: ") and "restart" in result["again"], result["again"]
        assert "PipelineError" not in result["again"]


def run_case(case: Case) -> list[Any]:
    return run_distributed(failing_worker, K, case, timeout=40, pg_timeout=20, expect_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("output", "slow_first"), [("last", False), ("all", False), ("all", True)])
def test_forward_failure(output: str, slow_first: bool) -> None:
    results = run_case(Case("train", where="forward", output=output, slow_first=slow_first))
    assert_every_rank_raised(results, "stage 1 failed in the forward phase (micro-batch 1): ValueError: boom")


@pytest.mark.timeout(60)
def test_backward_failure() -> None:
    # Checkpointed: the error arises in the backward of the recomputed micro-batch, the first one drained.
    results = run_case(Case("train", where="backward", checkpoint="always"))
    assert_every_rank_raised(results, f"stage 1 failed in the backward phase (micro-batch {M - 1}): ValueError: boom")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_middle_stage_failure_under_nccl_rules(where: str) -> None:
    """K = 3 at dp = 1 on the link groups, each queue run in posting order as NCCL runs it: a failure on the middle
    stage reaches both ends by the headers, and the data queues posted ahead of it are aborted, within the limit."""
    results = run_case(Case("train", where=where, checkpoint="always", nccl=True))
    micro_batch = 1 if where == "forward" else M - 1
    assert_every_rank_raised(results, f"stage 1 failed in the {where} phase (micro-batch {micro_batch}): ValueError")


@pytest.mark.timeout(60)
def test_evaluation_failure() -> None:
    results = run_case(Case("evaluate", where="forward"))
    assert_every_rank_raised(results, "stage 1 failed in the evaluation phase (micro-batch 1): ValueError: boom")


@pytest.mark.timeout(60)
def test_abort_in_loss_on_last_stage() -> None:
    results = run_case(Case("abort_in_loss"))
    assert_every_rank_raised(results, "stage 2 failed in the step phase: ValueError: loss is nan")


@pytest.mark.timeout(60)
def test_abort_on_first_stage_before_forward() -> None:
    results = run_case(Case("abort_first"))
    assert_every_rank_raised(results, "stage 0 failed in the step phase: ValueError: bad batch")


TIMEOUT_S = 3.0


def skipping_worker(rank: int, world_size: int, nccl: bool = False) -> dict[str, Any]:
    """Stage 0 skips the backward phase (a rank-dependent branch in user code); the others run it."""
    if nccl:
        os.environ[ENV] = "1"
    stage = GPipeStage(boom_model(Case("train")), chunks=M, balance=BALANCE, timeout=TIMEOUT_S)
    x, target = make_input("mlp", N), make_input("mlp", N, seed=1)
    out = stage(x)
    if stage.is_first:
        # Alive but elsewhere: a process that exited would show up as a closed connection, not a timeout.
        time.sleep(4 * TIMEOUT_S)
        return {"outcome": "skipped"}
    if out is not None:
        loss_fn(out, target).backward()
    start = time.monotonic()
    try:
        stage.backward()
    except PipelineError as e:
        return raised(e, start)
    return {"outcome": "returned", "elapsed": time.monotonic() - start}


@pytest.fixture(scope="module")
def skipped_backward() -> list[Any]:
    # One launch for the two tests below: it costs a few timeouts of wall time.
    return run_distributed(skipping_worker, K, timeout=40, pg_timeout=20, expect_errors=True)


@pytest.mark.timeout(60)
def test_peer_skipping_backward_times_out(skipped_backward: list[Any]) -> None:
    for rank in (1, 2):
        result = skipped_backward[rank]
        assert isinstance(result, dict), f"rank {rank} crashed instead of raising PipelineTimeout:\n{result}"
        assert result["outcome"] == "raised" and result["type"] == "PipelineTimeout", result
        assert "probably" in result["message"], result["message"]  # suggests a cause
        assert TIMEOUT_S - 0.5 <= result["elapsed"] < 10, result


@pytest.mark.timeout(60)
def test_peer_skipping_backward_is_named(skipped_backward: list[Any]) -> None:
    result = skipped_backward[1]
    assert "stage 0" in result["message"], result["message"]
    assert result["elapsed"] < TIMEOUT_S + 2, result  # one timeout, not two
    # Stage 2's sends all reached stage 1 (gloo says so only from a wait: each pending send gets a short one).
    assert "never received" not in skipped_backward[2]["message"], skipped_backward[2]


@pytest.mark.timeout(60)
def test_a_hung_peer_under_nccl_rules_is_a_timeout_on_the_others() -> None:
    """The same skipped backward with each data group's transfers in posting order (NCCL's rules): the stages that
    wait raise PipelineTimeout naming stage 0 within the timeout + 5 s, not a hang of the data queues."""
    results = run_distributed(skipping_worker, K, True, timeout=40, pg_timeout=20, expect_errors=True)
    for rank in (1, 2):
        result = results[rank]
        assert isinstance(result, dict) and result["outcome"] == "raised", (rank, result)
        assert result["type"] == "PipelineTimeout", (rank, result)
        assert result["elapsed"] < TIMEOUT_S + 5, (rank, result)
    assert "stage 0 never received" in results[1]["message"], results[1]
    assert "never received" not in results[2]["message"], results[2]  # stage 1 took all stage 2 sent
