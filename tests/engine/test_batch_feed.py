"""BatchFeed: stage 0 loads each batch once; the other stages of its pipeline get the same batches, in order."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from lightning_gpipe.pipe.batch_feed import pack, unpack
from tests.helpers.launch import run_distributed

Pair = namedtuple("Pair", ["x", "y"])


def _batches(n: int, stream: int = 0) -> list:
    """Batches of mixed structure and dtypes, each different (a namedtuple, a dict, a string, a non-contiguous
    tensor, an empty one)."""
    out = []
    for i in range(n):
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (i + 1) + stream * 100
        out.append(
            {
                "pair": Pair(x.t(), torch.tensor([i, stream])),
                "ids": torch.arange(i + 1, dtype=torch.int64),
                "mask": torch.ones(2, i + 1, dtype=torch.bool),
                "half": torch.full((2,), i / 3, dtype=torch.bfloat16),
                "empty": torch.empty(0, 5),
                "name": f"s{stream}b{i}",
            }
        )
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_pack_unpack_round_trip_copies_every_tensor() -> None:
    for batch in _batches(3):
        packed = pack(batch)
        assert _same(unpack(packed), batch)
        batch["pair"].x.add_(1)  # the step changes its batch in place while the copy crosses
        assert not _same(unpack(packed), batch)


def _feed_worker(rank: int, world_size: int) -> list:
    from lightning_gpipe.pipe.batch_feed import BatchFeed

    group = dist.new_group(list(range(world_size)), backend="gloo")
    feed = BatchFeed(group, is_source=rank == 0, timeout_s=30.0)
    seen: list = []

    def loader(n: int, stream: int):  # only stage 0 may iterate it
        if rank != 0:
            raise AssertionError("a stage other than 0 iterated its loader")
        yield from _batches(n, stream)

    it = iter(feed.stream(loader(6, 0)))
    seen.append([next(it) for _ in range(2)])  # then abandoned, as limit_train_batches leaves an epoch
    seen.append(list(feed.stream(loader(4, 1))))  # a new epoch
    outer = iter(feed.stream(loader(3, 2)))
    inner_batches = [next(outer)]
    seen.append(list(feed.stream(loader(2, 3))))  # validation opens inside a training epoch
    seen.append(inner_batches)
    feed.close()
    expected = [_batches(6, 0)[:2], _batches(4, 1), _batches(2, 3), _batches(3, 2)[:1]]
    return [len(s) for s in seen], _same(seen, expected)  # plain values: tensors would cross in shared memory


@pytest.mark.timeout(120)
def test_every_stage_gets_stage_zeros_batches_in_order() -> None:
    """Three stages: an abandoned stream, a full one, one opened inside another; only stage 0 iterates."""
    results = run_distributed(_feed_worker, 3, timeout=100)
    assert results == [([2, 4, 2, 1], True)] * 3


def _failing_worker(rank: int, world_size: int) -> str:
    from lightning_gpipe.pipe.batch_feed import BatchFeed

    group = dist.new_group(list(range(world_size)), backend="gloo")
    feed = BatchFeed(group, is_source=rank == 0, timeout_s=30.0)

    def loader():
        yield torch.zeros(2)
        raise ValueError("corrupt image 17.jpg")

    got = []
    try:
        for batch in feed.stream(loader() if rank == 0 else []):
            got.append(batch)
    except Exception as error:
        return f"{len(got)} {type(error).__name__}: {error}"
    finally:
        feed.close()
    return "no error"


@pytest.mark.timeout(120)
def test_a_loader_error_on_stage_zero_raises_on_every_stage() -> None:
    stage0, stage1 = run_distributed(_failing_worker, 2, timeout=100)
    assert stage0 == "1 ValueError: corrupt image 17.jpg"
    assert stage1 == "1 RuntimeError: stage 0's data loader raised ValueError: corrupt image 17.jpg"
