"""float16/bfloat16 dp means are divided before the sum (it cannot overflow), float32 ones after it (one rounding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.dp.grads import BucketedAllReduce, OverlappedReduction
from lightning_gpipe.pipe.dp.hierarchy import Hierarchy, build_hierarchies
from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets
from tests.helpers.launch import run_distributed

WORLD = 4
# Each replica's gradient is finite, their sum over 4 replicas is not (float16's max is 65504, bfloat16's ~3.39e38).
NEAR_MAX = {torch.float16: 40000.0, torch.bfloat16: 2.0e38}
SIZES = (3, 17, 64, 5)
BUCKET_BYTES = 40  # several buckets, and a tensor larger than one


def _grad(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # Near the max, each replica a little apart, so that the mean is not any one replica's value.
    scale = torch.linspace(0.5, 1.0, n, dtype=torch.float64) * (1 - 0.05 * rank)
    return (scale * NEAR_MAX[dtype]).to(dtype)


def _params(rank: int, dtype: torch.dtype, with_grads: bool = True) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES]
    for p in params:
        p.grad = _grad(rank, p.numel(), dtype) if with_grads else None
    return params


def _ready(params: list[nn.Parameter], hierarchy: Hierarchy | None, late: bool, rank: int) -> None:
    ready = ReadyBuckets(params, dist.group.WORLD, BUCKET_BYTES, hierarchy)
    ready.arm()  # no backward op follows: launch_rest sends every planned bucket (ReadyBuckets' own launches)
    if late:  # no gradient when armed: the late parameters' reduction (a BucketedAllReduce inside)
        for p in params:
            p.grad = _grad(rank, p.numel(), p.dtype)
    ready.launch_rest().wait()


def low_precision_worker(rank: int, world_size: int) -> dict[str, list[list[float]]]:
    h = build_hierarchies([list(range(world_size))], lambda r: r // 2, rank)  # nodes {0, 1} and {2, 3}
    paths: dict[str, Callable[[list[nn.Parameter]], None]] = {}
    for name, hierarchy in (("flat", None), ("hierarchical", h)):
        paths[f"{name} bucketed"] = lambda ps, hi=hierarchy: BucketedAllReduce(
            ps, dist.group.WORLD, BUCKET_BYTES, hierarchy=hi
        )()
        paths[f"{name} overlapped"] = lambda ps, hi=hierarchy: OverlappedReduction(
            ps, ps[1:2], dist.group.WORLD, BUCKET_BYTES, hi
        )(lambda: None)
        paths[f"{name} ready"] = lambda ps, hi=hierarchy: _ready(ps, hi, late=False, rank=rank)
    results: dict[str, list[list[float]]] = {}  # lists: tensors do not cross the result queue
    for dtype in NEAR_MAX:
        for name, reduce in paths.items():
            params = _params(rank, dtype)
            reduce(params)
            results[f"{dtype} {name}"] = [p.grad.double().tolist() for p in params]  # type: ignore[union-attr]
        params = _params(rank, dtype, with_grads=False)
        _ready(params, None, late=True, rank=rank)
        results[f"{dtype} ready late"] = [p.grad.double().tolist() for p in params]  # type: ignore[union-attr]
    return results


@pytest.mark.timeout(120)
def test_low_precision_means_do_not_overflow() -> None:
    out = run_distributed(low_precision_worker, WORLD, timeout=100)
    for rank, results in enumerate(out):
        assert len(results) == 2 * 7, results.keys()
        for name, grads in results.items():
            dtype = next(d for d in NEAR_MAX if name.startswith(str(d)))
            for n, values in zip(SIZES, grads):
                got = torch.tensor(values, dtype=torch.float64)
                per_replica = [_grad(r, n, dtype).double() for r in range(WORLD)]
                # The sum overflows in the grad dtype: the old sum-then-divide gave inf here.
                assert torch.isinf(sum(per_replica).to(dtype)).any(), "the case exercises an overflowing sum"
                want = sum(per_replica) / WORLD
                assert torch.isfinite(got).all(), (rank, name, got)
                # Divided by 4 exactly, then 3 additions, each rounded in the grad dtype.
                torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=0, msg=f"{rank} {name}")
            assert grads == out[0][name], (rank, name)  # every replica holds the very same mean


# ---------------------------------------------------------------- float32: still summed, then divided


def _integers(rank: int, n: int) -> torch.Tensor:
    return torch.randint(-(2**20), 2**20, (n,), generator=torch.Generator().manual_seed(rank)).float()


def float32_worker(rank: int, world_size: int) -> Any:
    three = dist.new_group([0, 1, 2])  # collective: every rank creates it
    if rank == 3:
        return None
    params = [nn.Parameter(torch.zeros(n)) for n in SIZES]
    for p in params:
        p.grad = _integers(rank, p.numel())
    BucketedAllReduce(params, three, BUCKET_BYTES)()
    return [p.grad.tolist() for p in params]  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_float32_means_are_the_sum_divided_once() -> None:
    """Integers sum exactly in any order: the one rounding is the division by 3, which dividing first misses."""
    out = run_distributed(float32_worker, WORLD, timeout=100)
    divided_first_differs = False
    for i, n in enumerate(SIZES):
        per_replica = [_integers(r, n) for r in range(3)]
        want = (per_replica[0] + per_replica[1] + per_replica[2]) / 3
        divided_first = per_replica[0] / 3 + per_replica[1] / 3 + per_replica[2] / 3
        divided_first_differs |= not torch.equal(divided_first, want)
        for rank in range(3):
            assert torch.equal(torch.tensor(out[rank][i]), want), (rank, i)
    assert divided_first_differs, "the case tells the two orders apart"
