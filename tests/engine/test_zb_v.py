"""ZB-V (``placement="v"``: rank r holds stages r and 2K − 1 − r, rank 0 the first and the last): the plain model's run,
exactly, under both transports' rules; its hand-off in the middle, its failures, its evaluation."""

from __future__ import annotations

import copy
import os
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.comm.nccl_order import ENV
from lightning_gpipe.pipe.errors import PipelineError
from lightning_gpipe.pipe.schedule.registry import executed
from lightning_gpipe.pipe.trace.gantt import block_label
from tests.helpers import guide_unet as unet
from tests.helpers import models
from tests.helpers.chunked import F32, F64, TOLS, batchnorm_worker, chain, micro_losses, parity_worker, rel_err
from tests.helpers.launch import run_distributed

# (N, H) per step of the U-Net: uneven micro-batches, a new image size every step.
UNET_STEPS = [(7, 8), (5, 12), (9, 4)]


def tied_v(dtype: torch.dtype) -> nn.Sequential:
    """Layer 0's weight used again by layer 7 (stage 3: rank 0 again in a V at K = 2) and layer 3 (stage 1: rank 1):
    one tie within rank 0, one across the ranks."""
    model = chain(8, dtype)
    model[7].weight = model[0][0].weight
    model[3].weight = model[0][0].weight
    return model


def _chain8(dtype: torch.dtype) -> nn.Sequential:
    return chain(8, dtype)


def _chain12(dtype: torch.dtype) -> nn.Sequential:
    return chain(12, dtype)


def _chain16(dtype: torch.dtype) -> nn.Sequential:
    return chain(16, dtype)


@pytest.mark.parametrize(
    ("K", "cases", "ordered"),
    [
        (
            2,
            [
                (_chain8, 2, [2, 2, 2, 2], F64, "sgd", "except_last"),  # M = K
                (_chain8, 4, "parameters", F64, "adam", "always"),  # balance solved for the V's 2K stages
                (_chain8, 3, [1, 3, 2, 2], F64, "sgd", "never"),  # M = 3 < 2K − 1 + 1, uneven
                (_chain8, 5, [2, 2, 2, 2], F32, "adam", "except_last"),
                (tied_v, 4, [2, 2, 2, 2], F64, "sgd", "except_last"),
            ],
            False,
        ),
        (3, [(_chain12, 3, [2] * 6, F64, "sgd", "except_last"), (_chain12, 7, "parameters", F64, "adam", "always")], 1),
        (4, [(_chain16, 8, [2] * 8, F64, "adam", "except_last")], True),
    ],
)
@pytest.mark.timeout(150)
def test_zb_v_is_the_plain_models_run(K: int, cases: list[tuple], ordered: bool) -> None:
    """Gradients, losses and the weights after three SGD or Adam steps equal the plain model's (float64 ≤ 1e-12, fp32
    ≤ 1e-6) at K = 2, 3, 4: M below, at and above 2K − 1 (the micro-batches torch's ZBV is built for), uneven
    micro-batches, a new sequence length each step, every re-materialization mode, a weight tied within rank 0 (its
    first and last stage) and one tied across ranks; at K = 3 and 4 under NCCL's ordering rules (modelled on gloo),
    where every link carries activations one way and gradients the same way, each on its own group."""
    per_rank = run_distributed(parity_worker, K, 2, cases, "zb-v", ordered, timeout=140)
    for case_i, case in enumerate(cases):
        keys = set()
        for rank, results in enumerate(per_rank):
            _, got = results[case_i]
            assert all(e <= TOLS[case[3]] for e in got["errs"].values()), (rank, case, got["errs"])
            keys |= set(got["keys"])
        assert keys == set(case[0](case[3]).state_dict()), case
        if case[0] is tied_v:  # layers 0 and 7 on rank 0, one parameter there; layer 3 on rank 1: summed over both
            assert all(res[case_i][1]["shared"] == [("0.0.weight", (0, 1))] for res in per_rank)


def layout_worker(rank: int, world_size: int) -> dict[str, Any]:
    stage = GPipeStage(chain(12, F64), chunks=4, balance=[1, 2, 3, 2, 3, 1], virtual_stages=2, placement="v")
    return {
        "ranges": [list(r) for r in stage.layer_ranges],
        "last": (stage.is_first, stage.is_last, stage.last_rank),
        "remote": str(stage[6]) if rank == 0 else "",
    }


@pytest.mark.timeout(60)
def test_each_rank_holds_a_stage_going_down_and_one_coming_back() -> None:
    r0, r1, r2 = run_distributed(layout_worker, 3, timeout=50)
    assert r0["ranges"] == [[0], [11]] and r1["ranges"] == [[1, 2], [8, 9, 10]] and r2["ranges"] == [[3, 4, 5], [6, 7]]
    assert r0["last"] == (True, True, 0) and r1["last"] == (False, False, 0) and r2["last"] == (False, False, 0)
    assert "layer 6 (Sequential) is on rank 2 (stage 3); this rank is 0 and holds layer 0, layer 11" in r0["remote"]


def phases_worker(rank: int, world_size: int, ordered: bool) -> dict[str, Any]:
    """``stage(x)`` + ``backward()``, evaluation with the output shared ("all", "first"), and the schedule, in a V."""
    if ordered:
        os.environ[ENV] = "1"
    model = chain(8, F64)
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=4, balance=[2] * 4, virtual_stages=2, placement="v", timeline=True, output="all")
    x = models.make_input("mlp", 9, 3, seed=1).double()
    target = torch.randn(9, 3, models.D, generator=torch.Generator().manual_seed(5)).double()
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
        stage.output_mode = "first"
        first = stage(x)
        errs["first"] = rel_err(first, ref_out.detach()) if rank == 0 else float(first.abs().max())
        stage.output_mode = "all"
    stage.zero_grad()
    stage.timeline.clear()
    losses = stage.forward_backward(x, micro_losses(target, stage.micro_batch_sizes(x)), schedule="zb-v")
    errs["zb-v"] = max(rel_err(p.grad, ref.get_parameter(n).grad) for n, p in stage.named_parameters())
    if stage.is_last:
        errs["loss"] = rel_err(torch.stack(losses).sum(), models.loss_fn(ref_out, target).detach())
    compute = [
        e for e in stage.timeline.events if e.kind in ("forward", "backward", "backward-input", "backward-weight")
    ]
    wrong = ""
    try:
        stage.forward_backward(x, micro_losses(target, stage.micro_batch_sizes(x)), schedule="interleaved-1f1b")
    except ValueError as e:
        wrong = str(e)
    return {"errs": errs, "labels": [block_label(e) for e in compute], "wrong": wrong, "losses": len(losses)}


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.timeout(60)
def test_phases_evaluation_and_the_schedule_in_a_v(ordered: bool) -> None:
    """The output comes out on rank 0, which holds the last stage: shared with rank 1 ("all") or kept there ("first",
    rank 1 gets zeros); the loss is computed there; the gradients are the plain model's; the timeline runs the
    registry's order (rank 0's chunk a backward fused, as ``fuse_halves`` runs it); a schedule for the other
    placement is refused on every rank before any transfer."""
    r0, r1 = run_distributed(phases_worker, 2, ordered, timeout=50)
    for rank, r in enumerate((r0, r1)):
        assert all(e <= 1e-12 for e in r["errs"].values()), (rank, r["errs"])
        want = [f"{a.kind}{a.m}{'ab'[a.c]}" for a in executed("zb-v", 2, 4, 2)[rank]]
        assert r["labels"] == want, (rank, r["labels"])
        assert "build the stage with GPipeStage(placement='loop') to run it" in r["wrong"], r["wrong"]
    assert r0["losses"] == 4 and r1["losses"] == 0 and "loss" in r0["errs"]


@pytest.mark.timeout(60)
def test_deferred_batchnorm_in_a_v() -> None:
    for rank, errs in enumerate(run_distributed(batchnorm_worker, 2, "zb-v", timeout=50)):
        assert all(e <= 1e-12 for e in errs.values()), (rank, errs)


def skips_worker(rank: int, world_size: int) -> dict[str, Any]:
    """The guide's U-Net at K = 2 in a V, stages [3, 3, 2, 6] on ranks 0, 1, 1, 0: 'full' goes from stage 0 to stage
    3, both on rank 0 (handed over), 'half' from stage 1 (rank 1) to stage 3 (rank 0)."""
    warnings.simplefilter("ignore")
    os.environ[ENV] = "1"
    out: dict[str, Any] = {}
    for mode in ("except_last", "always"):
        model = unet.make()
        ref = copy.deepcopy(model)
        stage = GPipeStage(model, chunks=4, balance=[3, 3, 2, 6], checkpoint=mode, virtual_stages=2, placement="v")
        err = 0.0
        for step, (N, H) in enumerate(UNET_STEPS):
            x, target = unet.images(N, H, seed=step)
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), target).backward()
            stage.zero_grad()
            unet.run_step(stage, x, target, "zb-v")
            err = max(err, *(rel_err(p.grad, ref.get_parameter(n).grad) for n, p in stage.named_parameters()))
        transport = stage._executor.links.transport  # type: ignore[union-attr]
        out[mode] = (err, dict(transport.bytes_sent))
    return out


@pytest.mark.timeout(120)
def test_skips_in_a_v_are_handed_over_within_rank_0_and_sent_from_rank_1() -> None:
    results = run_distributed(skips_worker, 2, timeout=110)
    for rank, r in enumerate(results):
        for mode, (err, _) in r.items():
            assert err <= 1e-9, (rank, mode, err)
    # Rank 0 sends stage 0's output, and stage 3's input gradient and that of 'half'; rank 1 sends stage 2's output
    # (to stage 3), 'half', and stage 1's input gradient (stage 0's output's shape). 'full' and stage 1 → 2 stay.
    model, out0, half, out2 = unet.make(), 0, 0, 0
    for N, H in UNET_STEPS:
        x, _ = unet.images(N, H, seed=0)
        with torch.no_grad():
            y0 = model[:3](x)
            h = model[3](y0)  # 'half' is what layer 3 stashes
            y2 = model[3:8](y0)
        out0, half, out2 = out0 + y0.nbytes, half + h.nbytes, out2 + y2.nbytes
    sent0, sent1 = (r["except_last"][1] for r in results)
    assert sum(sent0.values()) == out0 + half + out2, (sent0, out0, half, out2)
    assert sum(sent1.values()) == out2 + half + out0, (sent1, out0, half, out2)


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("the backward of layer 11 failed")


class BackwardFails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailsInBackward.apply(x)


def failing_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0's chunk b (the last stage, 5 of 6) fails in micro-batch 0's backward while rank 1 waits for that
    gradient and rank 2 for rank 1's: each neighbour's notice passes it on, down the V (no ring)."""
    model = chain(12, F64)
    model[11] = BackwardFails()
    stage = GPipeStage(model, chunks=3, balance=[2] * 6, virtual_stages=2, placement="v", timeout=20)
    start = time.monotonic()
    try:
        stage.forward_backward(models.make_input("mlp", 6).double(), lambda y, m: y.sum(), schedule="zb-v")
    except PipelineError as e:
        return {"text": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - start}
    return {"text": "no error", "elapsed": time.monotonic() - start}


@pytest.mark.timeout(60)
def test_a_failure_on_the_last_stage_reaches_every_rank_of_the_v() -> None:
    for rank, got in enumerate(run_distributed(failing_worker, 3, timeout=50)):
        place = "its chunk b, the backbone in a V's stage 5"
        assert got["text"].startswith(f"PipelineError: stage 0 failed in the train phase (micro-batch 0, {place}): "), (
            rank,
            got,
        )
        assert got["elapsed"] < 15, (rank, got)  # the notices, not the 20 s timeout


def test_bad_placements_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"placement='v' holds two stages per rank .* but virtual_stages=3"):
        GPipeStage(chain(8, F64), chunks=4, virtual_stages=3, placement="v")  # before the one-rank check
    with pytest.raises(ValueError, match="placement='ring': 'loop'"):
        GPipeStage(chain(8, F64), chunks=4, placement="ring")  # type: ignore[arg-type]
