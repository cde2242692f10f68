"""The loss inside the pipeline (GPipeStage.forward_backward): the executor's schedules, the plain model's run."""

from __future__ import annotations

import copy
import itertools
import re
import warnings
from typing import Any, get_args

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.errors import PipelineError
from lightning_gpipe.pipe.run.loss_inside import LossFn, rank_actions
from lightning_gpipe.pipe.schedule.registry import SCHEDULES, Action, ScheduleName, keeps_graph, lookup
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from tests.helpers import models
from tests.helpers.launch import run_distributed
from tests.helpers.parity import (
    BALANCES,
    MICRO,
    MODES,
    SHAPES,
    TOL,
    check_cases,
    compare_grads,
    compare_running_stats,
    rel_err,
)

# The schedules of one chunk per rank (interleaving has its own tests: test_interleaved.py).
ONE_CHUNK = tuple(name for name, spec in SCHEDULES.items() if spec.accepts(1))


@pytest.mark.parametrize(("K", "M"), [(1, 1), (2, 8), (3, 4), (4, 2), (4, 8), (8, 3)])
@pytest.mark.parametrize("schedule", ONE_CHUNK)
def test_op_lists_run_every_micro_batch_once_and_bound_what_is_in_flight(schedule: str, K: int, M: int) -> None:
    actions = rank_actions(schedule, K, M)  # type: ignore[arg-type]
    for k, ops in enumerate(actions):
        # zb-h1: I m and W m, or one B m where W m would follow I m at once (rank 0 always); never both.
        split = sorted(m for a, m, _ in ops if a == "I")
        assert split == sorted(m for a, m, _ in ops if a == "W")
        assert sorted(m for a, m, _ in ops if a == "B") == sorted(set(range(M)) - set(split))
        assert [m for a, m, _ in ops if a == "F"] == list(range(M))
        assert split == ([] if schedule != "zb-h1" or k == 0 else split) and (schedule != "zb-h1" or k == 0 or split)
        # Each W after its I, and not right after it.
        assert all(ops.index(Action("W", m)) > ops.index(Action("I", m)) + 1 for m in split)
        assert ops[-1].kind in ("B", "W")
        expected = min(M, K - k) if schedule == "1f1b" or k == K - 1 else M
        if schedule == "gpipe" and k == K - 1:
            expected = 1
        if schedule == "fill-drain":  # the last rank too holds every micro-batch until the first loss
            expected = M
        if schedule == "zb-h1":  # rank k keeps k more micro-batches until their W
            expected = min(M, K)
        assert simulate(actions, K).peak[k] == expected, (k, ops)
    if schedule == "zb-h1":  # ZB-H1 (F = I = W = 1, B = 2): 3M + K − 1 units where 1F1B takes 3(M + K − 1)
        makespan = simulate(actions, K, nccl=False).makespan
        assert makespan == 3 * M + K - 1 if M >= K else makespan <= 3 * (M + K - 1)
        return
    # 2(M + K − 1) units with unit costs: GPipe's bubble, no more.
    assert simulate(actions, K, costs=Costs(B=1), nccl=False).makespan == 2 * (M + K - 1)


def test_the_registry_holds_every_schedule_name_once() -> None:
    assert tuple(SCHEDULES) == get_args(ScheduleName)
    assert all(name == spec.name for name, spec in SCHEDULES.items())
    assert ONE_CHUNK == ("gpipe", "fill-drain", "1f1b", "zb-h1")
    names = "['gpipe', 'fill-drain', '1f1b', 'interleaved-1f1b', 'zb-h1', 'interleaved-zb', 'zb-v']"
    with pytest.raises(ValueError, match=re.escape(f"schedule='zb-h2' is not one of {names}")):
        lookup("zb-h2")


def test_except_last_keeps_the_graphs_whose_backward_comes_next() -> None:
    ops = rank_actions("1f1b", 3, 4)[1]  # F0 F1 B0 F2 B1 F3 B2 B3: the recompute of 3 fills the wait for its gradient
    assert not any(keeps_graph("except_last", ops, m) for m in range(4))
    assert keeps_graph("except_last", rank_actions("1f1b", 3, 1)[0], 0)  # F0 B0
    last = rank_actions("1f1b", 3, 4)[2]
    assert all(keeps_graph("except_last", last, m) for m in range(4))
    assert not any(keeps_graph("always", last, m) for m in range(4))
    assert all(keeps_graph("never", ops, m) for m in range(4))


def token_mean(out: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss averaged over the tokens whose id is not 0 (padding): (sum of terms, token count)."""
    mask = (ids != 0).to(out.dtype)
    return ((out.pow(2).mean(-1) * mask).sum(), mask.sum())


def micro_loss(loss: str, tgt: torch.Tensor, ids: torch.Tensor, sizes: list[int]) -> LossFn:
    """Micro-batch m's share of the whole batch's loss: weight n_m/N for a mean over samples, tokens_m/tokens for
    a mean over tokens."""
    N, offsets = sum(sizes), [sum(sizes[:m]) for m in range(len(sizes))]
    tokens = token_mean(torch.zeros((*ids.shape, 1)), ids)[1]

    def fn(y: torch.Tensor, m: int) -> torch.Tensor:
        lo, hi = offsets[m], offsets[m] + sizes[m]
        if loss == "mean":
            return models.loss_fn(y, tgt[lo:hi]) * (sizes[m] / N)
        return token_mean(y, ids[lo:hi])[0] / tokens

    return fn


def run_case(kind: str, M: int, mode: str, schedule: str, balance: list[int], loss: str) -> dict[str, float]:
    """Three optimizer steps with the loss per micro-batch, and the same on the plain model."""
    torch.manual_seed(1234)
    backbone = models.MODELS[kind]()
    prefix = nn.Linear(models.D, models.D) if kind == "mlp" else nn.Identity()
    ref_backbone, ref_prefix = copy.deepcopy(backbone), copy.deepcopy(prefix)
    stage = GPipeStage(backbone, chunks=M, balance=balance, checkpoint=mode)
    opt = torch.optim.SGD([*stage.parameters(), *prefix.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([*ref_backbone.parameters(), *ref_prefix.parameters()], lr=0.1)
    ref_params = dict(ref_backbone.named_parameters())
    errs = {"grad": 0.0, "loss": 0.0, "weight": 0.0, "prefix": 0.0}
    checked = 0
    for step, (N, T) in enumerate(SHAPES[kind]):
        x = models.make_input(kind, N, T, seed=step)
        ids = models.make_input("ids", N, T, seed=50 + step)  # padding (0) falls unevenly on the micro-batches
        ref_opt.zero_grad()
        ref_out = ref_backbone(ref_prefix(x))
        tgt = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(100 + step))
        if loss == "mean":
            ref_loss = models.loss_fn(ref_out, tgt)
        else:
            total, count = token_mean(ref_out, ids)
            ref_loss = total / count
        ref_loss.backward()
        opt.zero_grad()
        losses = stage.forward_backward(
            prefix(x), micro_loss(loss, tgt, ids, stage.micro_batch_sizes(x)), schedule=schedule
        )
        if stage.is_last:
            assert len(losses) == len(stage.micro_batch_sizes(x))
            errs["loss"] = max(errs["loss"], rel_err(torch.stack(losses).sum(), ref_loss.detach()))
        else:
            assert losses == []
        checked += compare_grads(stage, ref_params, (prefix, ref_prefix) if kind == "mlp" else None, errs)
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref_params[name].detach()))
    errs["params_checked"] = checked
    return errs


CASES = [
    (kind, M, mode, schedule, loss)
    for kind, M, mode, schedule in itertools.product(models.MODELS, MICRO, MODES, ONE_CHUNK)
    for loss in (("mean", "tokens") if kind == "cells" else ("mean",))
    if schedule != "zb-h1" or mode != "never"  # its I keeps what "never" keeps: "except_last" on the last stage
]


def parity_worker(rank: int, world_size: int) -> list[tuple[tuple, dict[str, float]]]:
    warnings.simplefilter("ignore")  # N < M warns by design
    return [(case, run_case(*case[:4], BALANCES[world_size], case[4])) for case in CASES]  # type: ignore[misc]


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.timeout(400)
def test_loss_in_the_pipeline_equals_plain_model(K: int) -> None:
    """Every runnable schedule, K stages, M ∈ {1, 2, 4, 8} (M < K too), every re-materialization mode, uneven and
    too-small batches, changing shapes, a mean over samples and a mean over tokens (weights n_m/N and tokens_m/tokens);
    zb-h1's weight gradients of Linear and Embedding deferred to W."""
    checked = check_cases(run_distributed(parity_worker, K, timeout=380))
    counts = {kind: len(list(make().parameters())) for kind, make in models.MODELS.items()}
    assert checked == sum(counts[case[0]] for case in CASES) * 3


def batchnorm_worker(rank: int, world_size: int, schedule: str) -> dict[str, float]:
    """Deferred BatchNorm under each schedule: micro-batch normalization, mini-batch statistics committed once."""
    torch.manual_seed(0)
    model = models.with_bn()
    ref = copy.deepcopy(model)
    M = 4
    stage = GPipeStage(model, chunks=M, balance=[2, 4], checkpoint="except_last")
    full_bn = {i: copy.deepcopy(ref[i]) for i in (1, 4)}
    ref_params = dict(ref.named_parameters())
    errs = {"grad": 0.0, "mean": 0.0, "var": 0.0, "tracked": 0.0}
    for step, N in enumerate((10, 13)):
        x = models.make_input("mlp", N, seed=step)
        inputs: dict[int, list[torch.Tensor]] = {1: [], 4: []}
        hooks = [ref[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0])) for i, got in inputs.items()]
        sizes = micro_batch_sizes(N, M)
        ref_out = torch.cat([ref(mb) for mb in x.split(sizes)])
        for h in hooks:
            h.remove()
        for i, bn in full_bn.items():
            bn(torch.cat(inputs[i]))
        tgt = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step))
        ref.zero_grad()
        models.loss_fn(ref_out, tgt).backward()
        stage.zero_grad()
        stage.forward_backward(x, micro_loss("mean", tgt, x[:, 0], sizes), schedule=schedule)
        # Relative to the stage's largest gradient: a bias right before a BatchNorm has a gradient of zero in exact
        # arithmetic, so only rounding noise is left of it on both sides.
        scale = max(ref_params[n].grad.abs().max().item() for n, _ in stage.named_parameters())
        diffs = [(p.grad - ref_params[n].grad).abs().max().item() / scale for n, p in stage.named_parameters()]
        errs["grad"] = max([errs["grad"], *diffs])
    compare_running_stats(stage, full_bn, errs)
    return errs


@pytest.mark.parametrize("schedule", ONE_CHUNK)
@pytest.mark.timeout(120)
def test_deferred_batchnorm_under_every_schedule(schedule: str) -> None:
    for rank, errs in enumerate(run_distributed(batchnorm_worker, 2, schedule, timeout=100)):
        assert all(v <= TOL for v in errs.values()), (rank, errs)


def bad_loss_worker(rank: int, world_size: int) -> str:
    stage = GPipeStage(models.mlp(), chunks=2, balance=[4, 4])
    try:
        stage.forward_backward(models.make_input("mlp", 6), lambda y, m: y)  # not a scalar
    except PipelineError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_a_loss_that_is_not_a_scalar_fails_every_stage_with_the_reason() -> None:
    for rank, message in enumerate(run_distributed(bad_loss_worker, 2, timeout=100)):
        assert "must be a scalar tensor, got a tensor of shape (3, 8)" in message, (rank, message)


MIXED_STEPS = [(10, 5), (7, 9), (2, 4)]  # uneven micro-batches, a new sequence length each step, then M = 2 < K = 3


def mixed_run(dropout: float, schedule: str, balance: list[int], mode: str) -> dict[str, Any]:
    """Three steps of ``mixed(dropout)``: each step's gradients, how often each parameter's hook fired, the events."""
    torch.manual_seed(0)
    stage = GPipeStage(models.mixed(dropout), chunks=4, balance=balance, checkpoint=mode, timeline=True)
    fired = {name: 0 for name, _ in stage.named_parameters()}
    for name, p in stage.named_parameters():
        p.register_hook(lambda g, name=name: fired.__setitem__(name, fired[name] + 1))
    torch.manual_seed(7)
    grads = []
    for step, (N, T) in enumerate(MIXED_STEPS):
        ids = models.make_input("ids", N, T, seed=step)
        tgt = torch.randn(N, T, models.D, generator=torch.Generator().manual_seed(100 + step))
        stage.zero_grad(set_to_none=True)
        stage.forward_backward(ids, micro_loss("mean", tgt, ids, stage.micro_batch_sizes(ids)), schedule=schedule)
        grads.append({n: p.grad.tolist() for n, p in stage.named_parameters()})
    return {"grads": grads, "fired": fired, "kinds": sorted({e.kind for e in stage.timeline.events})}


def mixed_worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    warnings.simplefilter("ignore")  # N < M warns by design
    balance = {2: [3, 3], 3: [2, 2, 2]}[world_size]
    runs = [(0.3, "zb-h1", "always"), (0.3, "1f1b", "always"), (0.0, "zb-h1", "except_last")]
    return [mixed_run(dropout, schedule, balance, mode) for dropout, schedule, mode in runs]


def plain_mixed_grads() -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = models.mixed(0.0)
    grads = []
    for step, (N, T) in enumerate(MIXED_STEPS):
        ids = models.make_input("ids", N, T, seed=step)
        tgt = torch.randn(N, T, models.D, generator=torch.Generator().manual_seed(100 + step))
        model.zero_grad(set_to_none=True)
        models.loss_fn(model(ids), tgt).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.timeout(120)
def test_zb_h1_defers_linear_conv_and_embedding_weight_gradients_and_is_the_same_run(K: int) -> None:
    """Embedding, Linear, LayerNorm, Conv1d, a custom parameter, dropout, the model's own checkpoint: zb-h1's
    gradients (W for the split ops, I for the others) are 1F1B's bit for bit, with the same dropout masks
    (recomputed: ``always``), and the plain model's (≤ 1e-6); every parameter's hook fires once per micro-batch, as
    under 1F1B; I and W are traced apart (rank 0, whose W's follow their I's, runs plain backwards)."""
    plain = plain_mixed_grads()
    for rank, (got, one_f_one_b, no_dropout) in enumerate(run_distributed(mixed_worker, K, timeout=100)):
        if rank == 0:  # each W right after its I: run as one backward (fuse_halves)
            assert "backward" in got["kinds"] and "backward-input" not in got["kinds"], rank
        else:
            assert {"backward-input", "backward-weight"} <= set(got["kinds"]), rank
        assert got["fired"] == one_f_one_b["fired"], rank
        assert min(got["fired"].values()) == 4 + 4 + 2, rank  # once per micro-batch of every step
        assert got["grads"] == one_f_one_b["grads"], rank
        for step, want in enumerate(plain):
            for name, g in no_dropout["grads"][step].items():
                assert rel_err(torch.tensor(g), want[name]) <= TOL, (rank, step, name)
