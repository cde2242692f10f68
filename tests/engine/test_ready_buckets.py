"""ReadyBuckets: a stage's dp buckets leave during its last backward op, and the means equal a reduction after it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.dp.grads import BucketedAllReduce
from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets
from tests.helpers import models
from tests.helpers.launch import run_distributed

N = 10


def _step(stage: GPipeStage, replica: int, step: int, hooks: dict[str, Any], schedule: str = "1f1b") -> None:
    M = stage.chunks
    x = models.make_input("mlp", N, seed=10 * step + replica)  # different data on each replica
    tgt = torch.randn(N, models.D, generator=torch.Generator().manual_seed(100 + 10 * step + replica))
    sizes = micro_batch_sizes(N, M)
    lo = [sum(sizes[:m]) for m in range(M)]
    stage.zero_grad(set_to_none=True)
    stage.forward_backward(
        x, lambda y, m: models.loss_fn(y, tgt[lo[m] : lo[m] + sizes[m]]) * sizes[m] / N, schedule=schedule, **hooks
    )


def ready_worker(
    rank: int,
    world_size: int,
    M: int,
    frozen: bool,
    bucket_bytes: int = 64,
    tail_bytes: int | None = None,
    schedule: str = "1f1b",
) -> dict[str, Any]:
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp, replica = pp_groups[rank // 2], dp_groups[rank % 2], rank // 2
    torch.manual_seed(0)
    backbone = models.mlp()
    if frozen:  # a parameter without a gradient anywhere must stay None, as DDP leaves it
        backbone[2 if rank % 2 == 0 else 6][0].bias.requires_grad_(False)
    stage = GPipeStage(backbone, chunks=M, balance=[4, 4], group=pp)
    params = list(stage.parameters())
    # 64 bytes: about one parameter per bucket; or one bucket for all, whose tail cut makes them leave one by one
    ready = ReadyBuckets(params, dp, bucket_bytes, tail_bytes=tail_bytes)
    launches: list[int] = []
    ends: list[int] = []
    real = dist.all_reduce

    def logged(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if group is dp and tensor.is_floating_point():
            launches.append(time.perf_counter_ns())
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = logged
    same, during = True, []
    try:
        for step in range(3):
            pending: list[Any] = []

            def drained(pending: list[Any] = pending) -> None:
                ends.append(time.perf_counter_ns())
                pending.append(ready.launch_rest())

            launches.clear()
            _step(stage, replica, step, {"before_last_backward": ready.arm, "drained": drained}, schedule)
            pending[0].wait()
            got = [None if p.grad is None else p.grad.clone() for p in params]
            during.append(sum(t < ends[-1] for t in launches))
            _step(stage, replica, step, {}, schedule)
            BucketedAllReduce(params, dp, bucket_bytes=64)()
            want = [p.grad for p in params]
            same = same and all(
                (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w))
                for g, w in zip(got, want)
            )
    finally:
        dist.all_reduce = real
    assert ready._reduce is not None
    return {"same": same, "during": during, "buckets": ready._reduce.num_buckets}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("M", "frozen", "bucket_bytes", "tail_bytes", "schedule"),
    [
        (4, False, 64, None, "1f1b"),
        (4, True, 64, None, "1f1b"),
        (1, False, 64, None, "1f1b"),
        (4, False, 2**25, 64, "1f1b"),
        (4, True, 64, None, "zb-h1"),
    ],
    ids=["all trained", "one frozen per stage", "M=1", "one bucket, its tail cut", "zb-h1: during the last W"],
)
def test_buckets_leave_during_the_last_backward_with_the_same_means(
    M: int, frozen: bool, bucket_bytes: int, tail_bytes: int | None, schedule: str
) -> None:
    """Under zb-h1 the last op is the last W: the deferred weight gradients fire their hooks there."""
    results = run_distributed(ready_worker, 4, M, frozen, bucket_bytes, tail_bytes, schedule, timeout=100)
    for rank, r in enumerate(results):
        assert r["same"], rank  # bit for bit: each element summed over the same two replicas
        if M > 1:
            assert r["buckets"] > 4, (rank, r)  # the stage's 4 layers' parameters: about one bucket each
            # Every step some buckets left before the last backward op ended (its first layers' gradients were
            # not final yet), not all of them after.
            assert all(d >= 1 for d in r["during"]), (rank, r)
        else:  # no gradient before the only backward op: every parameter is late, reduced after it
            assert r["during"] == [0, 0, 0], (rank, r)


def test_the_last_bucket_is_cut_small() -> None:
    """Planned in the order given; only what the last full-size bucket holds is cut into buckets of ≤ tail_bytes."""
    layers = [torch.nn.Linear(16, 16) for _ in range(6)]  # 1088 bytes each: weight 1024, bias 64
    params = [p for layer in layers for p in layer.parameters()]
    plain = BucketedAllReduce(params, None, bucket_bytes=2500)
    cut = BucketedAllReduce(params, None, bucket_bytes=2500, tail_bytes=1024)
    size = lambda bucket: sum(p.numel() * p.element_size() for p in bucket)  # noqa: E731
    assert [len(b) for b in plain.buckets] == [4, 4, 4]
    assert cut.buckets[:2] == plain.buckets[:2]
    assert [size(b) for b in cut.buckets[2:]] == [1024, 64, 1024, 64]
    assert [p for b in cut.buckets for p in b] == params
    assert BucketedAllReduce(params, None, 2500, tail_bytes=4096).buckets == plain.buckets  # a larger tail: no cut
