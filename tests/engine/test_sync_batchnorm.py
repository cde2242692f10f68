"""Deferred BatchNorm synced over data-parallel replicas: the step of nn.BatchNorm on the union of their batches."""

from __future__ import annotations

import contextlib
import copy
import pickle
import time
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.dp.grads import BucketedAllReduce
from lightning_gpipe.pipe.state.batchnorm import (
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    deferral,
    deferred_statistics,
    is_deferred,
    sync_deferred_batch_norm,
)
from tests.helpers.launch import run_distributed

TOL = 1e-6  # fp32, relative to the largest magnitude of the reference tensor
# The pipeline runs in float64: fp32 rounding (~1e-7 per BatchNorm backward, near TOL after a few layers and steps)
# would blur the comparison, while a wrong statistic or gradient term is off by far more than this.
PIPE_DTYPE, PIPE_TOL = torch.float64, 1e-10
M = 3
C_IN, C_MID, D = 2, 4, 6
BALANCE = {1: [8], 2: [4, 4]}
BNS = (1, 5)  # indices of the BatchNorm layers in backbone(); one per stage when K = 2
# N of each of the 2 replicas, per step: even, and uneven (also within a replica: 5 = 2 + 2 + 1, a lone sample that
# plain per-micro-batch BatchNorm1d would reject).
SIZES = {"even": [(7, 7), (7, 7), (7, 7)], "uneven": [(7, 5), (5, 7), (8, 6)]}


def backbone() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        # No bias before a BatchNorm: its true gradient is zero, so only rounding noise would be compared.
        nn.Conv2d(C_IN, C_MID, 3, padding=1, bias=False),
        nn.BatchNorm2d(C_MID),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(C_MID * 16, D, bias=False),
        nn.BatchNorm1d(D, momentum=None),  # cumulative average: num_batches_tracked must count steps exactly
        nn.Tanh(),
        nn.Linear(D, D),
    ).to(PIPE_DTYPE)


def data(step: int, replica: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Replicas draw from different distributions, so local statistics are far from the global ones.
    g = torch.Generator().manual_seed(100 * step + replica)
    x = (1.0 + replica) * torch.randn(n, C_IN, 4, 4, generator=g, dtype=PIPE_DTYPE) + 3.0 * replica
    return x, torch.randn(n, D, generator=g, dtype=PIPE_DTYPE)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def mesh(rank: int, world_size: int, K: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """rank = d·K + k; every rank creates every group in the same order, as new_group requires."""
    dp = world_size // K
    pipelines = [dist.new_group([d * K + k for k in range(K)]) for d in range(dp)]
    replicas = [dist.new_group([d * K + k for d in range(dp)]) for k in range(K)]
    return pipelines[rank // K], replicas[rank % K]


def count_collectives(group: dist.ProcessGroup) -> Counter:
    """Count this process's all_reduce / all_gather calls on ``group`` from now on."""
    calls: Counter = Counter()
    for name in ("all_reduce", "all_gather"):
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            if kwargs.get("group") is group:
                calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def reference_step(
    ref: nn.Sequential, full: dict[int, nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """One data-parallel step on one process: micro-batch m of the union = the replicas' m-th micro-batches together;
    the loss is the mean over replicas of each replica's mean loss, as dp gradient averaging makes it. The full BNs see
    each layer's input of the whole global mini-batch once."""
    dp = len(batches)
    splits = [x.split(micro_batch_sizes(len(x), M)) for x, _ in batches]
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in full}
    hooks = [
        ref[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0].detach())) for i, got in inputs.items()
    ]
    outs: list[list[torch.Tensor]] = [[] for _ in batches]
    for m in range(M):
        y = ref(torch.cat([s[m] for s in splits]))
        for out, piece in zip(outs, y.split([len(s[m]) for s in splits])):
            out.append(piece)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for i, bn in full.items():
            bn(torch.cat(inputs[i]))
    joined = [torch.cat(out) for out in outs]
    ref.zero_grad()
    (sum(F.mse_loss(out, t) for out, (_, t) in zip(joined, batches)) / dp).backward()
    return [out.detach() for out in joined]


def pipeline_case(K: int, groups: tuple[dist.ProcessGroup, dist.ProcessGroup], mode: str, steps: list) -> dict:
    d = dist.get_rank() // K
    pipe_group, dp_group = groups
    model = backbone()
    ref = copy.deepcopy(model)
    full = {i: copy.deepcopy(ref[i]) for i in BNS}
    stage = GPipeStage(model, chunks=M, balance=BALANCE[K], checkpoint=mode, group=pipe_group, output="last")
    norms = [m for m in stage.modules() if is_deferred(m)]
    synced = sync_deferred_batch_norm(stage, dp_group)
    dp_reduce = BucketedAllReduce(list(stage.parameters()), dp_group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    errs = {"out": 0.0, "grad": 0.0, "weight": 0.0, "mean": 0.0, "var": 0.0, "eval": 0.0}
    calls = count_collectives(dp_group)
    counts: dict[str, list[int]] = {"forward": [], "backward": [], "gather": []}
    for step, sizes in enumerate(steps):
        batches = [data(step, e, n) for e, n in enumerate(sizes)]
        ref_outs = reference_step(ref, full, batches)
        opt.zero_grad()
        before = calls.copy()
        out = stage(batches[d][0])
        counts["forward"].append(calls["all_reduce"] - before["all_reduce"])
        counts["gather"].append(calls["all_gather"] - before["all_gather"])
        if out is not None:
            F.mse_loss(out, batches[d][1]).backward()
            errs["out"] = max(errs["out"], rel_err(out.detach(), ref_outs[d]))
        before = calls.copy()
        stage.backward()
        counts["backward"].append(calls["all_reduce"] - before["all_reduce"])
        dp_reduce()
        for name, p in stage.named_parameters():
            errs["grad"] = max(errs["grad"], rel_err(p.grad, ref_params[name].grad))
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref_params[name].detach()))
    stats = {}
    for name, bn in stage.named_children():
        if is_deferred(bn):
            want = full[int(name)]
            errs["mean"] = max(errs["mean"], rel_err(bn.running_mean, want.running_mean))
            errs["var"] = max(errs["var"], rel_err(bn.running_var, want.running_var))
            stats[name] = [bn.running_mean.tolist(), bn.running_var.tolist(), int(bn.num_batches_tracked)]
    for i, want in full.items():  # every layer, also those of the other stage, which feed this stage's input
        for buffer in ("running_mean", "running_var"):  # not the weights: `want` never trained them
            getattr(ref[i], buffer).copy_(getattr(want, buffer))
    stage.eval()
    ref.eval()
    before = calls.copy()
    with torch.no_grad():
        x, _ = data(99, d, 5)
        out = stage(x)
        if out is not None:
            errs["eval"] = rel_err(out, ref(x))
    counts["eval"] = [calls["all_reduce"] - before["all_reduce"] + calls["all_gather"] - before["all_gather"]]
    return {"errs": errs, "stats": stats, "counts": counts, "layers": (synced, len(norms))}


def pipeline_worker(rank: int, world_size: int, K: int, modes: list[str]) -> dict:
    groups = mesh(rank, world_size, K)
    return {(mode, case): pipeline_case(K, groups, mode, SIZES[case]) for mode in modes for case in SIZES}


def check_pipeline(K: int, modes: list[str]) -> None:
    per_rank = run_distributed(pipeline_worker, 2 * K, K, modes, timeout=170)
    recomputed = {"always": M, "except_last": M - 1, "never": 0}
    for rank, results in enumerate(per_rank):
        assert set(results) == {(mode, case) for mode in modes for case in SIZES}
        for (mode, case), result in results.items():
            where = (rank, mode, case)
            bad = {k: v for k, v in result["errs"].items() if v > PIPE_TOL}
            assert not bad, (where, bad)
            synced, layers = result["layers"]
            assert synced == layers == len(BNS) // K, where
            # Per BN and micro-batch: 2 all-reduces forward (sum, M2), 2 backward, 2 again per recompute; per
            # step, one all_gather compares M across replicas and one merges the running statistics of all layers;
            # none in eval.
            steps = len(SIZES[case])
            assert result["counts"]["forward"] == [2 * M * layers] * steps, where
            assert result["counts"]["backward"] == [2 * (M + recomputed[mode]) * layers] * steps, where
            assert result["counts"]["gather"] == [2] * steps, where
            assert result["counts"]["eval"] == [0], where
            for stats in result["stats"].values():
                assert stats[2] == steps, where  # committed once per step, never by a recompute
    # Replicas of a stage hold bit-identical running statistics.
    for k in range(K):
        for key, result in per_rank[k].items():
            assert result["stats"] and result["stats"] == per_rank[K + k][key]["stats"], (k, key)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("K", [1, 2])
def test_synced_pipeline_equals_union_of_replicas(K: int) -> None:
    """2 replicas × K stages, no re-materialization: gradients, weights, running statistics and eval output."""
    check_pipeline(K, ["never"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("K", [1, 2])
def test_synced_recompute_repeats_statistics_without_double_counting(K: int) -> None:
    """Recomputed micro-batches re-run the collectives and normalize alike; running statistics count once."""
    check_pipeline(K, ["always", "except_last"])


def sample(n: int, seed: int, offset: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return offset + torch.tensor([0.5, 1.0, 2.0]).view(1, 3, 1, 1) * torch.randn(n, 3, 2, 2, generator=g)


def group_of(bn: nn.Module) -> dist.ProcessGroup | None:
    state = deferral(bn)
    assert state is not None
    return state.sync_group


def plain_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Outside a pipeline a synced forward is nn.SyncBatchNorm; a deferred one merges float64 moments of replicas."""
    own = [dist.new_group([r]) for r in range(world_size)][rank]
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(3)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    bn = convert_deferred_batch_norm(copy.deepcopy(ref))
    result: dict[str, Any] = {"off": sync_deferred_batch_norm(bn, own), "off_group": group_of(bn) is None}
    result["on"] = sync_deferred_batch_norm(nn.Sequential(nn.ReLU(), bn), dist.group.WORLD)
    result["copy_unsynced"] = group_of(copy.deepcopy(bn)) is None and group_of(pickle.loads(pickle.dumps(bn))) is None
    errs = {"out": 0.0, "x_grad": 0.0, "w_grad": 0.0, "b_grad": 0.0, "mean": 0.0, "var": 0.0, "eval": 0.0}
    calls = count_collectives(dist.group.WORLD)
    for step, sizes in enumerate([(3, 5), (4, 2)]):
        # fp32 normalization: an offset near unit spread, as the reference's own rounding allows comparing at TOL.
        xs = [sample(n, 10 * step + e, offset=3.0 * e) for e, n in enumerate(sizes)]
        ups = [torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + e)) for e, x in enumerate(xs)]
        x_ref = torch.cat(xs).requires_grad_()
        ref.zero_grad()
        out_ref = ref(x_ref)
        (out_ref * torch.cat(ups)).sum().backward()
        x = xs[rank].clone().requires_grad_()
        bn.zero_grad()
        out = bn(x)
        (out * ups[rank]).sum().backward()
        for p in (bn.weight, bn.bias):  # the loss is the sum over replicas: their parameter gradients add up
            dist.all_reduce(p.grad)
        mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        errs["out"] = max(errs["out"], rel_err(out.detach(), out_ref[mine].detach()))
        errs["x_grad"] = max(errs["x_grad"], rel_err(x.grad, x_ref.grad[mine]))
        errs["w_grad"] = max(errs["w_grad"], rel_err(bn.weight.grad, ref.weight.grad))
        errs["b_grad"] = max(errs["b_grad"], rel_err(bn.bias.grad, ref.bias.grad))
        errs["mean"] = max(errs["mean"], rel_err(bn.running_mean, ref.running_mean))
        errs["var"] = max(errs["var"], rel_err(bn.running_var, ref.running_var))
    result["tracked"] = int(bn.num_batches_tracked)

    # Deferred: a large offset next to unit spread, where E[x²] − E[x]² would lose the variance; the float64 merge
    # of (count, mean, M2) over replicas must give nn.BatchNorm's running statistics of the union at TOL.
    for step, sizes in enumerate([(7, 5), (3, 6)]):
        xs = [sample(n, 30 + 10 * step + e, offset=1000.0 + e) for e, n in enumerate(sizes)]
        before = [bn.running_mean.clone(), bn.running_var.clone()]
        with deferred_statistics():
            for micro in xs[rank].split(micro_batch_sizes(len(xs[rank]), M)):
                bn(micro)
        unchanged = torch.equal(before[0], bn.running_mean) and torch.equal(before[1], bn.running_var)
        result["deferred_until_commit"] = result.get("deferred_until_commit", True) and unchanged
        commit_deferred_batch_norm(bn)
        ref(torch.cat(xs))
        errs["mean"] = max(errs["mean"], rel_err(bn.running_mean, ref.running_mean))
        errs["var"] = max(errs["var"], rel_err(bn.running_var, ref.running_var))
    result["tracked"] = (result["tracked"], int(bn.num_batches_tracked))

    bn.eval()
    ref.eval()
    before_calls = calls.copy()
    x = sample(4, 99, offset=1.0)
    errs["eval"] = rel_err(bn(x).detach(), ref(x).detach())
    result["eval_collectives"] = sum((calls - before_calls).values())
    result["errs"] = errs
    return result


@pytest.mark.timeout(120)
def test_synced_forward_outside_pipeline_is_sync_batch_norm() -> None:
    for result in run_distributed(plain_worker, 2, timeout=100):
        assert (result["off"], result["off_group"], result["on"]) == (1, True, 1)
        assert result["copy_unsynced"]
        assert result["tracked"] == (2, 4) and result["deferred_until_commit"] and result["eval_collectives"] == 0
        bad = {k: v for k, v in result["errs"].items() if v > TOL}
        assert not bad, bad


def different_m_worker(rank: int, world_size: int, K: int) -> str:
    pipe_group, dp_group = mesh(rank, world_size, K)
    stage = GPipeStage(backbone(), chunks=M, balance=BALANCE[K], group=pipe_group, output="last", timeout=60)
    sync_deferred_batch_norm(stage, dp_group)
    x, _ = data(0, rank // K, 6 if rank < K else 2)  # replica 1 gets 2 samples: M = 2, against 3 on replica 0
    start = time.monotonic()
    try:
        with pytest.warns(UserWarning, match="fewer than chunks") if rank == K else contextlib.nullcontext():
            stage(x)
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f} s: {e}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("K", [1, 2])
def test_replicas_with_different_m_fail_at_once_instead_of_falling_out_of_step(K: int) -> None:
    errors = run_distributed(different_m_worker, 2 * K, K, timeout=100)
    for error in errors:
        assert "M = [3, 2], one per replica" in error and "lower chunks" in error, errors
        # Timed from the call, not from the processes' start (slow on a loaded machine): the collectives' timeout is
        # 60 s, so this is the error, not a timeout.
        assert float(error.split(" after ")[1].split(" s:")[0]) < 50, error
