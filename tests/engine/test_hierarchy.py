"""Hierarchical all-reduce (4 processes as 2 nodes × 2): the same means as the flat reduction, on every path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.dp.grads import BucketedAllReduce, OverlappedReduction
from lightning_gpipe.pipe.dp.hierarchy import build_hierarchies
from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets
from tests.helpers.launch import run_distributed


def _params(rank: int, integer: bool) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(rank)
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 17, 64, 5)]
    for p in params:
        grad = (
            torch.randint(-1000, 1000, p.shape, generator=g).float() if integer else torch.randn(p.shape, generator=g)
        )
        p.grad = grad * (rank + 1)
    return params


def hierarchy_worker(rank: int, world_size: int, integer: bool) -> dict[str, Any]:
    groups = [list(range(world_size))]
    h = build_hierarchies(groups, lambda r: r // 2, rank)  # nodes {0, 1} and {2, 3}
    assert h is not None
    shape = {"nodes": h.nodes, "leader": h.leader, "leads": h.inter is not None, "intra": h.intra is not None}
    results: dict[str, list[list[float]]] = {}  # lists: tensors do not cross the result queue
    reduces: list[int] = []
    real = dist.reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        reduces.append(1)
        return real(*args, **kwargs)

    dist.reduce = counted
    for name in ("flat", "hierarchical"):
        params = _params(rank, integer)
        hierarchy = h if name == "hierarchical" else None
        BucketedAllReduce(params, dist.group.WORLD, bucket_bytes=100, hierarchy=hierarchy)()  # several buckets
        results[name] = [p.grad.tolist() for p in params]  # type: ignore[union-attr]
        # The overlapped reduction (own, then copied) and ReadyBuckets' late path give the same.
        params = _params(rank, integer)
        OverlappedReduction(params, params[1:2], dist.group.WORLD, 100, hierarchy)(lambda: None)
        results[f"{name} overlapped"] = [p.grad.tolist() for p in params]  # type: ignore[union-attr]
        params = _params(rank, integer)
        ready = ReadyBuckets(params, dist.group.WORLD, 100, hierarchy)
        ready.arm()  # no backward op follows: launch_rest sends every planned bucket
        ready.launch_rest().wait()
        results[f"{name} ready"] = [p.grad.tolist() for p in params]  # type: ignore[union-attr]
        shape[f"{name} intra-node reduces"] = len(reduces)
    dist.reduce = real
    return {"shape": shape, "results": results}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("integer", [True, False], ids=["integer values", "random values"])
def test_hierarchical_means_equal_the_flat_ones(integer: bool) -> None:
    out = run_distributed(hierarchy_worker, 4, integer, timeout=100)
    # Buckets of at most 100 bytes over 3, 17, 64, 5 floats: 3 flat ([3+17], [64], [5]), 4 overlapped (own [3],
    # [64], [5]; copied [17]), 3 ready (reversed: [5], [64], [17+3]): one intra-node reduce each.
    counts = {"flat intra-node reduces": 0, "hierarchical intra-node reduces": 10}
    assert [o["shape"] for o in out] == [
        {"nodes": 2, "leader": 0, "leads": True, "intra": True, **counts},
        {"nodes": 2, "leader": 0, "leads": False, "intra": True, **counts},
        {"nodes": 2, "leader": 2, "leads": True, "intra": True, **counts},
        {"nodes": 2, "leader": 2, "leads": False, "intra": True, **counts},
    ]
    expected = [sum(_params(r, integer)[i].grad * 1.0 for r in range(4)) / 4 for i in range(4)]  # type: ignore[misc]
    for rank, o in enumerate(out):
        for name, grads in o["results"].items():
            for got, want in zip(map(torch.tensor, grads), expected):
                if integer:  # sums of integers below 2^24: every order is exact
                    assert torch.equal(got, want), (rank, name)
                else:  # one rounding per addition, in another grouping
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (rank, name, (got - want).abs().max())
        # Every replica ends with the very same mean (the leader's, broadcast).
        for name in o["results"]:
            assert o["results"][name] == out[0]["results"][name], (rank, name)


def single_node_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Two data-parallel groups {0, 2} and {1, 3}, each with one replica per node: no intra-node step."""
    h = build_hierarchies([[0, 2], [1, 3]], lambda r: r // 2, rank)
    assert h is not None
    return {"intra": h.intra is None, "leads": h.inter is not None, "leader": h.leader}


@pytest.mark.timeout(60)
def test_one_replica_per_node_skips_the_intra_node_step() -> None:
    out = run_distributed(single_node_worker, 4, timeout=50)
    assert [(o["intra"], o["leads"], o["leader"]) for o in out] == [(True, True, r) for r in range(4)]
