"""Interleaved 1F1B (``virtual_stages`` = v ≥ 2, rank r holding chunks r, r + K, …): the plain model's run, exactly."""

from __future__ import annotations

import copy
import os
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.comm.nccl_order import ENV
from lightning_gpipe.pipe.errors import PipelineError
from lightning_gpipe.pipe.trace.gantt import block_label
from tests.helpers import models
from tests.helpers.chunked import F32, F64, TOLS, D, batchnorm_worker, chain, micro_losses, parity_worker, rel_err, tied
from tests.helpers.launch import run_distributed


def _chain8(dtype: torch.dtype) -> nn.Sequential:
    return chain(8, dtype)


def _chain12(dtype: torch.dtype) -> nn.Sequential:
    return chain(12, dtype)


@pytest.mark.parametrize(
    ("K", "v", "cases"),
    [
        (
            2,
            2,
            [
                (_chain8, 2, [2, 2, 2, 2], F64, "sgd", "except_last"),  # M = K
                (_chain8, 4, "parameters", F64, "adam", "always"),  # M = 2K, balance solved for vK chunks
                (_chain8, 3, [1, 3, 2, 2], F64, "sgd", "never"),  # M = 3 < 2K: not a multiple of K
                (_chain8, 4, [2, 2, 2, 2], F32, "adam", "except_last"),
                (tied, 4, [2, 2, 2, 2], F64, "sgd", "except_last"),
            ],
        ),
        (3, 2, [(_chain12, 3, [2] * 6, F64, "sgd", "except_last"), (_chain12, 6, "parameters", F64, "adam", "always")]),
        (2, 3, [(_chain12, 4, [2] * 6, F64, "sgd", "except_last")]),
    ],
)
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb"])
@pytest.mark.timeout(120)
def test_interleaving_is_the_plain_models_run(schedule: str, K: int, v: int, cases: list[tuple]) -> None:
    """Gradients, losses and the weights after three SGD or Adam steps equal the plain model's (float64 ≤ 1e-12,
    fp32 ≤ 1e-6): M = K, 2K and M = 3 (not a multiple of K), uneven micro-batches (10, 7, 13 samples), a new
    sequence length each step, every re-materialization mode, tied weights across ranks and within a rank; each
    rank's state-dict keys are the plain module's, and together all of them. Under "interleaved-zb" each backward is
    split, its weight gradients deferred."""
    per_rank = run_distributed(parity_worker, K, v, cases, schedule, timeout=100)
    for case_i, case in enumerate(cases):
        tol = TOLS[case[3]]
        keys = set()
        for rank, results in enumerate(per_rank):
            _, got = results[case_i]
            bad = {k: e for k, e in got["errs"].items() if e > tol}
            assert not bad, (rank, case, got["errs"])
            keys |= set(got["keys"])
        plain = case[0](case[3])
        assert keys == set(plain.state_dict()), case
        if case[0] is tied:  # layer 0 (rank 0) and 7 (rank 1): summed over both; layer 4 is rank 0's chunk b
            assert all(r["shared"] == [("0.0.weight", (0, 1))] for r in [res[case_i][1] for res in per_rank])


def layout_worker(rank: int, world_size: int) -> dict[str, Any]:
    stage = GPipeStage(chain(12, F64), chunks=4, balance=[1, 2, 3, 2, 3, 1], virtual_stages=3)
    return {
        "ranges": [list(r) for r in stage.layer_ranges],
        "params": [n for n, _ in stage.named_parameters()],
        "remote": str(stage[11]) if rank == 0 else "",
        "balance": stage.balance,
    }


@pytest.mark.timeout(60)
def test_each_rank_holds_every_kth_chunk_under_the_plain_names() -> None:
    r0, r1 = run_distributed(layout_worker, 2, timeout=50)
    assert r0["ranges"] == [[0], [3, 4, 5], [8, 9, 10]] and r1["ranges"] == [[1, 2], [6, 7], [11]]
    assert r0["balance"] == r1["balance"] == [1, 2, 3, 2, 3, 1]
    assert r0["params"][:2] == ["0.0.weight", "0.0.bias"] and r1["params"][:2] == ["1.weight", "1.bias"]
    assert (
        "layer 11 (Linear) is on rank 1 (stage 5); this rank is 0 and holds layer 0, layers 3–5, layers 8–10"
        in (r0["remote"])
    )


@pytest.mark.timeout(60)
def test_deferred_batchnorm_commits_each_chunks_statistics_once_per_step() -> None:
    for rank, errs in enumerate(run_distributed(batchnorm_worker, 2, "interleaved-1f1b", timeout=50)):
        assert all(e <= 1e-12 for e in errs.values()), (rank, errs)


def phases_worker(rank: int, world_size: int, ordered: bool) -> dict[str, Any]:
    """The phase API (``stage(x)``, ``backward()``), forward-only evaluation and the loss inside, each under NCCL's
    ordering rules when ``ordered``, with timelines."""
    if ordered:
        os.environ[ENV] = "1"
    model = chain(8, F64)
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=4, balance=[2, 2, 2, 2], virtual_stages=2, timeline=True, output="all")
    x = models.make_input("mlp", 9, 3, seed=1).double()
    target = torch.randn(9, 3, D, generator=torch.Generator().manual_seed(5)).double()
    ref_out = ref(x)
    models.loss_fn(ref_out, target).backward()
    out = stage(x)
    if stage.is_last:
        models.loss_fn(out, target).backward()
    stage.backward()
    errs = {"out": rel_err(out.detach(), ref_out.detach())}
    errs["grad"] = max(rel_err(p.grad, ref.get_parameter(n).grad) for n, p in stage.named_parameters())
    with torch.no_grad():
        errs["eval"] = rel_err(stage(x), ref_out.detach())
    stage.zero_grad()
    stage.timeline.clear()
    stage.forward_backward(x, micro_losses(target, stage.micro_batch_sizes(x)), schedule="interleaved-1f1b")
    errs["loss inside"] = max(rel_err(p.grad, ref.get_parameter(n).grad) for n, p in stage.named_parameters())
    compute = [e for e in stage.timeline.events if e.kind in ("forward", "backward")]
    stage.zero_grad()  # and with each backward split (two ranks exchange both kinds each way: their own groups)
    stage.forward_backward(x, micro_losses(target, stage.micro_batch_sizes(x)), schedule="interleaved-zb")
    errs["split"] = max(rel_err(p.grad, ref.get_parameter(n).grad) for n, p in stage.named_parameters())
    return {"errs": errs, "labels": [block_label(e) for e in compute], "names": sorted({e.name for e in compute})}


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.timeout(60)
def test_phases_evaluation_and_timeline_with_chunks(ordered: bool) -> None:
    """``stage(x)`` + ``backward()`` (the chunks one after the other), evaluation, interleaved 1F1B and interleaved
    zero bubble give the plain model's output and gradients; under NCCL's rules too (``nccl_order``: in-order
    rendezvous transfers, modelled on gloo). The timeline's compute blocks are named by micro-batch and chunk, in
    the schedule's order."""
    r0, r1 = run_distributed(phases_worker, 2, ordered, timeout=50)
    for rank, r in enumerate((r0, r1)):
        assert all(e <= 1e-12 for e in r["errs"].values()), (rank, r["errs"])
    # The order drawn in pipe/schedule/registry.py for K = 2, M = 4, v = 2 (B = backward, the recompute apart).
    assert " ".join(r0["labels"]) == "F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a B2b B3b B2a B3a"
    assert " ".join(r1["labels"]) == "F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a"
    assert "forward 3b" in r0["names"] and "backward 0a" in r1["names"]


def errors_worker(rank: int, world_size: int) -> list[str]:
    messages = []

    def attempt(fn: Any) -> None:
        try:
            fn()
            messages.append("no error")
        except (ValueError, PipelineError) as e:
            messages.append(str(e))

    x = models.make_input("mlp", 8)

    def loss(y: torch.Tensor, m: int) -> torch.Tensor:
        return y.sum()

    attempt(lambda: GPipeStage(chain(8, F64), chunks=4, balance=[4, 4], virtual_stages=2))
    attempt(lambda: GPipeStage(chain(8, F64), chunks=4, virtual_stages=0))
    two = GPipeStage(chain(8, F64), chunks=4, virtual_stages=2)
    attempt(lambda: two.forward_backward(x, loss, schedule="1f1b"))
    one = GPipeStage(chain(8, F64), chunks=4)
    attempt(lambda: one.forward_backward(x, loss, schedule="interleaved-1f1b"))
    five = GPipeStage(chain(8, F64), chunks=5, virtual_stages=2)
    attempt(lambda: five.forward_backward(models.make_input("mlp", 10), loss, schedule="interleaved-1f1b"))
    # chunks = 8 is admitted, but a short batch of 5 samples runs M = 5: refused on stage 0, reported everywhere.
    eight = GPipeStage(chain(8, F64), chunks=8, virtual_stages=2, timeout=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attempt(lambda: eight.forward_backward(models.make_input("mlp", 5), loss, schedule="interleaved-1f1b"))
    return messages


@pytest.mark.timeout(60)
def test_bad_interleaving_arguments_fail_on_every_rank_with_the_fix() -> None:
    for rank, got in enumerate(run_distributed(errors_worker, 2, timeout=50)):
        counts, zero, other, one, five, short = got
        assert "balance [4, 4] has 2 entries but there are 4 stages" in counts, (rank, counts)
        assert "virtual_stages=2: the pipeline's stages are its K·v = 2·2 = 4 virtual stages" in counts, (rank, counts)
        assert "virtual_stages (v, the stages each rank holds) must be an int ≥ 1, got 0" in zero, (rank, zero)
        assert (
            "schedule '1f1b' takes v = 1 virtual stages per rank, got v = 2; with several virtual stages per rank use "
            in other
        )
        assert (
            "schedule 'interleaved-1f1b' takes v ≥ 2 virtual stages per rank, got v = 1; with one chunk per rank" in one
        )
        assert re.search(r"chunks=5\): schedule 'interleaved-1f1b' runs M micro-batches in rounds .* M = 5 ", five)
        assert "M = 5 with K = 2 is not" in short, (rank, short)


def test_one_rank_cannot_interleave() -> None:
    with pytest.raises(ValueError, match="virtual_stages=2 interleaves stages over the ranks of a pipeline, but this"):
        GPipeStage(chain(8, F64), chunks=4, virtual_stages=2)


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("the backward of layer 6 failed")


class BackwardFails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailsInBackward.apply(x)


def failing_backward_worker(rank: int, world_size: int) -> str:
    """Rank 0's chunk b (stage 3 of 6) fails in micro-batch 0's backward, while rank 2 waits for that gradient: only a
    notice around the ring (rank 0 → rank 2) reaches it; rank 1 waits for rank 2, not rank 0."""
    model = chain(12, F64)
    model[6] = BackwardFails()
    stage = GPipeStage(model, chunks=3, balance=[2] * 6, virtual_stages=2, timeout=20)
    try:
        stage.forward_backward(models.make_input("mlp", 6).double(), lambda y, m: y.sum(), schedule="interleaved-1f1b")
    except PipelineError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_failure_reaches_every_rank_around_the_ring() -> None:
    """Every rank raises the failing rank's error within seconds (each neighbour's notice, K − 1 → 0 included), not
    a timeout after ``timeout`` seconds (the default: 30 minutes)."""
    for rank, text in enumerate(run_distributed(failing_backward_worker, 3, timeout=50)):
        place = "its chunk b, the interleaved backbone's stage 3"
        assert text.startswith(f"PipelineError: stage 0 failed in the train phase (micro-batch 0, {place}): "), (
            rank,
            text,
        )


def test_a_message_for_another_chunk_is_refused_by_its_header() -> None:
    """gloo hands over messages in the order they were sent: rank 0's chunk b (stage 2) checks that its input is
    micro-batch m's from stage 1, not from another stage, and a gradient is checked alike."""
    from lightning_gpipe.pipe.comm.links import Links, check_header
    from lightning_gpipe.pipe.trace.events import Timeline

    class Sent:
        def recv(self, src: int, what: str) -> tuple[torch.Tensor, dict[str, Any]]:
            return torch.zeros(1), {"m": 0, "M": 4, "n": 1, "training": True, "seed": 0, "stage": 3}

    links = Links(Sent(), None, index=0, timeline=Timeline(0))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="stage 2 waited for micro-batch 0's input and got micro-batch 0's from "):
        links.receive(0, training=True, src=1, stage=2, chunk=1)
    assert links.receive(0, training=True, src=1, stage=4, chunk=2)[1]["stage"] == 3
    with pytest.raises(RuntimeError, match="from stage 3 instead of stage 1's: the stages run their micro-batches"):
        check_header({"m": 1, "stage": 3}, 1, 1, 0, "output gradient")
