"""Gradient synchronization under pipeline × data parallelism must match one model trained on the whole batch."""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.dp.clipping import clip_grad_norm_, global_grad_norm
from lightning_gpipe.pipe.dp.grads import BucketedAllReduce, OverlappedReduction, sum_over_pipeline
from tests.helpers.launch import run_distributed

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def exact(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def exact64(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def params_like(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in specs]


def random_grads(specs: list[tuple[tuple[int, ...], torch.dtype]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in specs]


def mean_of(per_rank: list[torch.Tensor]) -> torch.Tensor:
    # Sum in the grad dtype as the all-reduce does, then divide (exact for two ranks).
    total = per_rank[0].clone()
    for t in per_rank[1:]:
        total += t
    return total / len(per_rank)


# ---------------------------------------------------------------- BucketedAllReduce, dp = 2

MIXED = [((3, 4), F32), ((7,), F32), ((2, 3, 5), F32), ((1,), F32), ((16, 16), F32), ((5,), F32)]
DP_CASES: dict[str, tuple[list, int]] = {
    "tiny-buckets": (MIXED, 64),
    "single-bucket": (MIXED, 2**30),
    "param-larger-than-bucket": ([((4,), F32), ((1000,), F32), ((6,), F32)], 256),
    "none-grad-on-one-rank": (MIXED, 128),
    "bf16-and-fp32": ([((8,), BF16), ((3, 3), F32), ((2, 5), BF16), ((11,), F32)], 2**20),
    "buffers-reused": (MIXED, 200),
    # As DDP: a grad None on every replica stays None (optimizers then skip the parameter: no momentum, no decay).
    "none-grad-everywhere": (MIXED, 128),
    # Frozen at construction, unfrozen later: still averaged once it has gradients.
    "unfrozen-after-construction": (MIXED, 128),
}


def _dp_case(name: str, rank: int, world_size: int) -> dict:
    specs, bucket_bytes = DP_CASES[name]
    params = params_like(specs)
    if name == "unfrozen-after-construction":
        params[1].requires_grad_(False)
    sync = BucketedAllReduce(params, dist.group.WORLD, bucket_bytes=bucket_bytes)
    params[1].requires_grad_(True)
    info = {"num_buckets": sync.num_buckets, "sizes": [len(b) for b in sync.buckets]}
    for step in range(2 if name == "buffers-reused" else 1):
        per_rank = [random_grads(specs, seed=100 * step + r) for r in range(world_size)]
        if name == "none-grad-on-one-rank":
            per_rank[1][2] = torch.zeros_like(per_rank[1][2])
        for i, p in enumerate(params):
            # A transposed (non-contiguous) grad must pack and unpack in place.
            p.grad = per_rank[rank][i].t().contiguous().t() if p.dim() == 2 else per_rank[rank][i].clone()
        if name == "none-grad-on-one-rank" and rank == 1:
            params[2].grad = None
        if name == "none-grad-everywhere":
            params[2].grad = params[4].grad = None
        grads_before = [p.grad for p in params]
        sync()
        for i, p in enumerate(params):
            if name == "none-grad-everywhere" and i in (2, 4):
                assert p.grad is None, i
                continue
            exact(p.grad, mean_of([grads[i] for grads in per_rank]))
            if grads_before[i] is not None:
                assert p.grad is grads_before[i], "grads are updated in place"
        if name == "buffers-reused":
            pointers = [b.data_ptr() for b in sync.buffers]
            info.setdefault("pointers", []).append(pointers)
    return info


def _dp_all(rank: int, world_size: int) -> dict[str, dict | str]:
    results: dict[str, dict | str] = {}
    for name in DP_CASES:
        try:
            results[name] = _dp_case(name, rank, world_size)
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def dp_results() -> list[dict[str, dict | str]]:
    return run_distributed(_dp_all, 2, timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(DP_CASES))
def test_bucketed_all_reduce_is_the_mean(dp_results: list[dict], name: str) -> None:
    for rank, results in enumerate(dp_results):
        assert not isinstance(results[name], str), f"rank {rank}:\n{results[name]}"
    info = dp_results[0][name]
    if name == "tiny-buckets":
        assert info["num_buckets"] >= 4
    elif name == "single-bucket":
        assert info["num_buckets"] == 1
    elif name == "param-larger-than-bucket":
        assert info["sizes"] == [1, 1, 1]
    elif name == "bf16-and-fp32":
        assert info["sizes"] == [2, 2]
    elif name == "buffers-reused":
        first, second = info["pointers"]
        assert first == second


@pytest.mark.timeout(10)
def test_no_group_is_a_no_op() -> None:
    params = params_like(MIXED)
    for p, g in zip(params, random_grads(MIXED, seed=0)):
        p.grad = g.clone()
    params[0].grad = None
    before = [None if p.grad is None else p.grad.clone() for p in params]
    BucketedAllReduce(params, None)()
    sum_over_pipeline(params, None)
    assert params[0].grad is None
    for p, b in zip(params[1:], before[1:]):
        assert torch.equal(p.grad, b)


# ---------------------------------------------------------------- sum_over_pipeline

REPLICATED = [((5, 3), F32), ((4,), F32), ((2, 2), BF16), ((6,), F32)]


def _replicated_grads(rank: int, world_size: int) -> list[torch.Tensor | None]:
    """Param 0 is used by the first stage only, 1 by the last only, 2 by every stage, 3 by none."""
    grads: list[torch.Tensor | None] = list(random_grads(REPLICATED, seed=rank))
    if rank != 0:
        grads[0] = None
    if rank != world_size - 1:
        grads[1] = None
    grads[3] = None
    return grads


def _sum_check(rank: int, world_size: int) -> bool:
    params = params_like(REPLICATED)
    for p, g in zip(params, _replicated_grads(rank, world_size)):
        p.grad = g
    sum_over_pipeline(params, dist.group.WORLD)
    per_rank = [_replicated_grads(r, world_size) for r in range(world_size)]
    for i, p in enumerate(params):
        if i == 3:  # None on every stage: stays None
            assert p.grad is None
            continue
        want = sum((grads[i] for grads in per_rank if grads[i] is not None), torch.zeros_like(p))
        exact(p.grad, want)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sum_over_pipeline(world_size: int) -> None:
    assert all(run_distributed(_sum_check, world_size, timeout=45))


# ---------------------------------------------------------------- global norm and clipping, pp = 3

STAGES = [[((4, 6), F32), ((6,), F32)], [((6, 6), F32), ((6,), F32), ((3,), F32)], [((6, 2), F32)]]
EMBED_HEAD = [((10, 4), F32), ((2, 6), F32)]  # the first stage uses the embedding, the last the head
NORMS = [2.0, 1.0, math.inf]


def _stage_grads(stage: int, seed: int) -> list[torch.Tensor | None]:
    grads: list[torch.Tensor | None] = list(random_grads(STAGES[stage], seed=seed + stage))
    if stage == 1:
        grads[2] = None  # an owned parameter this step did not reach
    return grads


def _replica_grads(stage: int, stages: int, seed: int) -> list[torch.Tensor | None]:
    embed, head = random_grads(EMBED_HEAD, seed=seed + 1000 + stage)
    return [embed if stage == 0 else None, head if stage == stages - 1 else None]


def _in(specs: list[tuple[tuple[int, ...], torch.dtype]], dtype: torch.dtype) -> list:
    return [(shape, dtype if d == F32 else d) for shape, d in specs]


def _reference(
    grads_of: Callable[[int], tuple[list, list]], stages: int, dtype: torch.dtype = F32
) -> tuple[list[nn.Parameter], list]:
    """One model holding every stage's owned parameters, then the replicated ones, with their summed grads."""
    ref = []
    for s in range(stages):
        for spec, g in zip(_in(STAGES[s], dtype), grads_of(s)[0]):
            ref.append(nn.Parameter(torch.zeros(spec[0], dtype=spec[1])))
            ref[-1].grad = None if g is None else g.clone()
    for i, spec in enumerate(_in(EMBED_HEAD, dtype)):
        parts = [grads_of(s)[1][i] for s in range(stages)]
        ref.append(nn.Parameter(torch.zeros(spec[0], dtype=spec[1])))
        ref[-1].grad = sum((g for g in parts if g is not None), torch.zeros(spec[0], dtype=spec[1]))
    return ref, [len(STAGES[s]) for s in range(stages)]


def _assign(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _norm_check(rank: int, world_size: int, dtype: torch.dtype) -> list[tuple[float, float]]:
    stages, group = world_size, dist.group.WORLD
    close = exact if dtype == F32 else exact64

    def grads_of(stage: int) -> tuple[list, list]:
        owned = [None if g is None else g.to(dtype) for g in _stage_grads(stage, seed=0)]
        return owned, [None if g is None else g.to(dtype) for g in _replica_grads(stage, stages, seed=0)]

    owned, replicated = params_like(_in(STAGES[rank], dtype)), params_like(_in(EMBED_HEAD, dtype))
    ref, counts = _reference(grads_of, stages, dtype)
    start = sum(counts[:rank])
    mine = ref[start : start + counts[rank]] + ref[-len(EMBED_HEAD) :]
    norms = []
    for p in NORMS:
        _assign(owned, grads_of(rank)[0])
        _assign(replicated, grads_of(rank)[1])
        sum_over_pipeline(replicated, group)
        norm = global_grad_norm(owned, replicated, p, group, count_replicated=rank == 0)
        want = torch.nn.utils.get_total_norm([q.grad for q in ref if q.grad is not None], p)
        assert norm.dtype == dtype
        close(norm, want)
        norms.append((p, norm.item()))
        for max_norm in (want.item() / 3, want.item() * 2):  # clipping and not clipping
            ref_copy = [nn.Parameter(q.detach().clone()) for q in ref]
            for q, r in zip(ref_copy, ref):
                q.grad = None if r.grad is None else r.grad.clone()
            _assign(owned, grads_of(rank)[0])
            _assign(replicated, grads_of(rank)[1])
            sum_over_pipeline(replicated, group)
            got = clip_grad_norm_(owned, replicated, max_norm, p, group, count_replicated=rank == 0)
            close(got, torch.nn.utils.clip_grad_norm_(ref_copy, max_norm, p))
            mine_ref = ref_copy[start : start + counts[rank]] + ref_copy[-len(EMBED_HEAD) :]
            assert len(mine) == len(mine_ref)
            for q, r in zip(owned + replicated, mine_ref):
                assert (q.grad is None) == (r.grad is None)
                if q.grad is not None:
                    assert q.grad.dtype == dtype
                    close(q.grad, r.grad)
    return norms


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_global_norm_and_clip_match_one_model(dtype: torch.dtype) -> None:
    per_rank = run_distributed(_norm_check, 3, dtype, timeout=120)
    assert per_rank[0] == per_rank[1] == per_rank[2], "every stage sees the same norm"


def _empty_stage_check(rank: int, world_size: int) -> list[float]:
    # Stage 1 holds no parameters (a stage of activations only): it joins stage 0's float64 sum as it is.
    specs = [((5, 3), F64), ((4,), F64)] if rank == 0 else []
    params, ref = params_like(specs), params_like(specs)
    got = []
    for p in NORMS:
        _assign(params, random_grads(specs, seed=3))
        _assign(ref, random_grads(specs, seed=3))
        got.append(clip_grad_norm_(params, [], 0.5, p, dist.group.WORLD, count_replicated=False).item())
        if rank == 0:
            exact64(torch.tensor(got[-1], dtype=F64), torch.nn.utils.clip_grad_norm_(ref, 0.5, p))
            for q, r in zip(params, ref):
                exact64(q.grad, r.grad)
    return got


@pytest.mark.timeout(60)
def test_a_stage_without_parameters_joins_a_float64_norm() -> None:
    with_params, without = run_distributed(_empty_stage_check, 2, timeout=45)
    # The stage without parameters has nothing to clip: it gets the same sum, in its own float32.
    assert without == [torch.tensor(n, dtype=F64).float().item() for n in with_params]


@pytest.mark.timeout(10)
def test_norm_is_float32_for_bf16_grads_and_local_without_group() -> None:
    params = params_like([((64,), BF16), ((3, 3), BF16)])
    for p, g in zip(params, random_grads([((64,), F32), ((3, 3), F32)], seed=1)):
        p.grad = g.to(BF16)
    upcast = [p.grad.float() for p in params]
    for p in NORMS:
        norm = global_grad_norm(params[:1], params[1:], p, None, count_replicated=True)
        assert norm.dtype == torch.float32
        exact(norm, torch.nn.utils.get_total_norm(upcast, p))
        only_owned = global_grad_norm(params[:1], params[1:], p, None, count_replicated=False)
        exact(only_owned, torch.nn.utils.get_total_norm(upcast[:1], p))
    with pytest.raises(ValueError, match="norm_type"):
        global_grad_norm(params, [], 0.0, None, count_replicated=True)


# ---------------------------------------------------------------- 2 × 2 mesh: pp {0,1},{2,3}; dp {0,2},{1,3}


def _mesh_check(rank: int, world_size: int) -> bool:
    # Every rank creates every group, in the same order.
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    stages, replicas = 2, 2

    def grads_of(s: int, r: int) -> tuple[list, list]:
        return _stage_grads(s, seed=10 * r), _replica_grads(s, stages, seed=10 * r)

    owned, replicated = params_like(STAGES[stage]), params_like(EMBED_HEAD)
    _assign(owned, grads_of(stage, replica)[0])
    _assign(replicated, grads_of(stage, replica)[1])
    sum_over_pipeline(replicated, pp_groups[replica])
    BucketedAllReduce(owned + replicated, dp_groups[stage], bucket_bytes=96)()
    norm = clip_grad_norm_(owned, replicated, 1.0, 2.0, pp_groups[replica], count_replicated=stage == 0)

    # The reference: each replica's whole model, averaged over replicas (a None grad averages as zeros where another
    # replica has one, and stays None where none has: DDP's rule), then clipped.
    refs = [_reference(lambda s, r=r: grads_of(s, r), stages)[0] for r in range(replicas)]
    ref = [nn.Parameter(q.detach().clone()) for q in refs[0]]
    for i, q in enumerate(ref):
        grads = [m[i].grad for m in refs]
        if all(g is None for g in grads):
            continue
        q.grad = mean_of([g if g is not None else torch.zeros_like(q) for g in grads])
    exact(norm, torch.nn.utils.clip_grad_norm_(ref, 1.0, 2.0))
    start = sum(len(STAGES[s]) for s in range(stage))
    mine = ref[start : start + len(STAGES[stage])] + ref[-len(EMBED_HEAD) :]
    for q, r in zip(owned + replicated, mine):
        assert (q.grad is None) == (r.grad is None)
        if r.grad is not None:
            exact(q.grad, r.grad)
    assert stage == 0 or any(q.grad is None for q in owned), "the case of a grad None everywhere is exercised"
    return True


@pytest.mark.timeout(60)
def test_pipeline_and_data_parallel_mesh() -> None:
    assert all(run_distributed(_mesh_check, 4, timeout=45))


# ---------------------------------------------------------------- overlapped reduction, 2 × 2 mesh


def _overlap_check(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Today's order (pipeline sums, then one reduction of everything) against the overlapped one, on the same grads:
    bit-identical results, and the own buckets launched before any pipeline collective."""
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = divmod(rank, 2)
    pp, dp = pp_groups[replica], dp_groups[stage]
    grads = _stage_grads(stage, seed=10 * replica), _replica_grads(stage, 2, seed=10 * replica)
    if stage == 0 and replica == 1:
        grads[0][1] = None  # an own parameter without a gradient on one replica only: zeros there
    # The replicated ones first, as module.parameters() lists an embedding before the backbone; then a head.
    replicated_a, owned, replicated_b = (
        params_like(EMBED_HEAD[:1]),
        params_like(STAGES[stage]),
        params_like(EMBED_HEAD[1:]),
    )
    replicated = replicated_a + replicated_b
    params = replicated_a + owned + replicated_b

    def assign() -> None:
        _assign(owned, grads[0])
        _assign(replicated, grads[1])

    assign()
    sum_over_pipeline(replicated, pp)
    BucketedAllReduce(params, dp, bucket_bytes=96)()
    want = [None if p.grad is None else p.grad.clone() for p in params]

    log: list[tuple[str, str]] = []
    launch = dist.all_reduce

    def logged(tensor: torch.Tensor, *args: object, group: object = None, **kwargs: object) -> object:
        kind = "flags" if tensor.dtype == torch.int32 else "bucket"
        log.append(("dp" if group is dp else "pp" if group is pp else "other", kind))
        return launch(tensor, *args, group=group, **kwargs)

    reduction = OverlappedReduction(params, replicated, dp, bucket_bytes=96)
    assert reduction.num_buckets >= 3
    dist.all_reduce = logged
    try:
        for _ in range(2):  # the second time on the buffers and plans of the first
            log.clear()
            assign()
            reduction(lambda: sum_over_pipeline(replicated, pp))
    finally:
        dist.all_reduce = launch
    for p, w in zip(params, want):
        assert (p.grad is None) == (w is None)
        if w is not None:
            assert torch.equal(p.grad, w), "bit-identical to pipeline sums, then one reduction"
    assert stage == 0 or any(p.grad is None for p in owned), "the case of a grad None everywhere is exercised"
    return log


@pytest.mark.timeout(60)
def test_overlapped_reduction_launches_own_buckets_before_pipeline_sums() -> None:
    logs = run_distributed(_overlap_check, 4, timeout=45)
    for log in logs:
        first_pp = log.index(("pp", "flags"))
        assert ("dp", "bucket") in log[:first_pp], log  # the own parameters' mean does not wait for the pipeline
        assert log[0] == ("dp", "flags") and ("dp", "bucket") in log[first_pp:], log
    # Every replica of a stage issues the same collectives in the same order (a mismatch would deadlock).
    assert logs[0] == logs[2] and logs[1] == logs[3]


# ---------------------------------------------------------------- the drain's end, before the status check, pp = 2

SLOW_S = 0.6


def _drained_check(rank: int, world_size: int) -> dict[str, list[int]]:
    """Stage 0 starts its drain late; each stage notes when its gradients are complete and when backward() returns."""
    from lightning_gpipe.pipe import GPipeStage
    from tests.helpers import models

    torch.manual_seed(0)
    stage = GPipeStage(models.mlp(), chunks=3, balance=[4, 4])
    times: dict[str, list[int]] = {"drained": [], "returned": []}
    for step in range(2):
        x = torch.randn(6, models.D, generator=torch.Generator().manual_seed(step))
        out = stage(x)
        if stage.is_last:
            out.pow(2).mean().backward()
        else:
            time.sleep(SLOW_S)  # a slow first stage
        stage.backward(drained=lambda: times["drained"].append(time.perf_counter_ns()))
        times["returned"].append(time.perf_counter_ns())
        assert all(p.grad is not None for p in stage.parameters())
    return times


@pytest.mark.timeout(60)
def test_drained_runs_before_the_status_check_waits_for_the_slowest_stage() -> None:
    first, last = run_distributed(_drained_check, 2, timeout=45)
    for step in range(2):
        assert len(last["drained"]) == len(first["drained"]) == 2, "once per backward phase"
        # The last stage's gradients are complete long before stage 0's drain ends; its backward() returns only after.
        assert last["drained"][step] < first["drained"][step] - SLOW_S / 2 * 1e9
        assert last["returned"][step] >= first["drained"][step]


# ---------------------------------------------------------------- the vote on which grads exist, on a CPU group


def _vote_check(rank: int, world_size: int) -> list[tuple[str, str, str]]:
    """Reductions over groups that claim NCCL, with gloo vote groups over the same ranks: every flag stays on the CPU
    and goes to a vote group, every gradient bucket to the reduction's group; the means are those of the default."""
    from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets

    dp, votes, pp, pp_votes = (dist.new_group([0, 1]) for _ in range(4))  # collective: all create all, in order
    solo = [dist.new_group([r]) for r in range(world_size)]
    labels = {id(dp): "dp", id(votes): "votes", id(pp): "pp", id(pp_votes): "pp votes"}
    specs = [((3, 4), F32), ((7,), BF16), ((16,), F32), ((5,), F32)]

    def fresh() -> list[nn.Parameter]:
        params = params_like(specs)
        _assign(params, list(random_grads(specs, seed=rank)))
        if rank == 1:
            params[1].grad = None  # a vote that matters: zeros here, the other replica's gradient there
        return params

    want = fresh()
    BucketedAllReduce(want, dp, bucket_bytes=64)()
    with pytest.raises(ValueError, match="vote_group"):
        BucketedAllReduce(want, dp, vote_group=solo[rank])

    log: list[tuple[str, str, str]] = []
    launch, backend = dist.all_reduce, dist.get_backend

    def logged(tensor: torch.Tensor, *args: object, group: object = None, **kwargs: object) -> object:
        log.append((labels.get(id(group), "other"), str(tensor.dtype), tensor.device.type))
        return launch(tensor, *args, group=group, **kwargs)

    def claimed(group: object = None) -> object:
        # A flag tensor made for these groups would go to CUDA (none here: it would fail, and the log would show it).
        return "nccl" if group is dp or group is pp else backend(group)  # type: ignore[arg-type]

    dist.all_reduce, dist.get_backend = logged, claimed  # type: ignore[assignment]
    try:
        results = []
        params = fresh()
        BucketedAllReduce(params, dp, bucket_bytes=64, vote_group=votes)()
        results.append(params)
        params = fresh()
        reduction = OverlappedReduction(params, params[2:3], dp, 64, vote_group=votes)
        reduction(lambda: sum_over_pipeline(params[2:3], pp, pp_votes))
        results.append(params)
        params = fresh()
        late = params[3].grad
        params[3].grad = None  # no gradient yet when armed: the late parameters' own vote
        ready = ReadyBuckets(params, dp, 64, vote_group=votes)
        ready.arm()
        params[3].grad = late
        ready.launch_rest().wait()
        results.append(params)
    finally:
        dist.all_reduce, dist.get_backend = launch, backend
    for i, got in enumerate(results):
        for j, (g, w) in enumerate(zip(got, want)):
            if i == 1 and j == 2:  # summed over the pipeline (here the same two ranks) first, then averaged
                assert w.grad is not None and torch.equal(g.grad, w.grad * 2), (i, j)
            else:
                assert g.grad is not None and w.grad is not None and torch.equal(g.grad, w.grad), (i, j)
    return log


@pytest.mark.timeout(60)
def test_the_vote_runs_on_the_vote_group_and_stays_on_the_cpu() -> None:
    logs = run_distributed(_vote_check, 2, timeout=45)
    assert logs[0] == logs[1], "every rank issues the same collectives in the same order"
    flags = [entry for entry in logs[0] if entry[1] == "torch.int32"]
    buckets = [entry for entry in logs[0] if entry[1] != "torch.int32"]
    # Bucketed: 1 vote; overlapped: own, pipeline, copied; ready: armed, late.
    assert [group for group, _, _ in flags] == ["votes", "votes", "pp votes", "votes", "votes", "votes"], logs[0]
    assert all(device == "cpu" for _, _, device in flags), logs[0]
    assert {group for group, _, _ in buckets} == {"dp", "pp"}, logs[0]


def _replica_groups_check(rank: int, world_size: int) -> list[list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gpipe.strategy._mesh import _own_group, _rank_sets

    out = []
    for K in (1, 2, 4):
        mesh = init_device_mesh("cpu", (world_size // K, K), mesh_dim_names=("dp", "pp"))
        dp = mesh["dp"].get_group()
        twin = _own_group(_rank_sets(mesh, "dp"), rank, timedelta(seconds=33))
        assert dist.get_backend(twin) == "gloo"
        assert twin._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=33)
        assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(dp), K
        BucketedAllReduce([], dp, vote_group=twin)  # accepted as the dp group's vote group
        out.append(dist.get_process_group_ranks(twin))
    return out


@pytest.mark.timeout(60)
def test_the_mesh_gloo_twin_of_the_dp_group_holds_its_ranks() -> None:
    """Where the dp group is NCCL, GPipeStrategy votes over this gloo twin (made on every rank, in one order)."""
    got = run_distributed(_replica_groups_check, 4, timeout=45)
    assert got[1] == [[0, 1, 2, 3], [1, 3], [1]]
