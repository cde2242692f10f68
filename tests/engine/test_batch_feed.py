"""BatchFeed: stage 0 loads each batch once; the other stages of its pipeline get the same batches, in order."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist

from lightning_gpipe.pipe.comm.batch_feed import pack, unpack
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


class _Loader:
    """A loader of ``n`` batches; only stage 0 may iterate it (elsewhere the feed must not touch it)."""

    def __init__(self, rank: int, n: int, stream: int) -> None:
        self.rank, self.n, self.stream = rank, n, stream

    def __iter__(self):
        if self.rank != 0:
            raise AssertionError("a stage other than 0 iterated its loader")
        return iter(_batches(self.n, self.stream))


def _feed_worker(rank: int, world_size: int) -> tuple:
    from lightning_gpipe.pipe.comm.batch_feed import BatchFeed

    group = dist.new_group(list(range(world_size)), backend="gloo")
    feed = BatchFeed(group, is_source=rank == 0, timeout_s=30.0)
    train, val, other = _Loader(rank, 6, 0), _Loader(rank, 2, 1), _Loader(rank, 5, 2)
    seen: list = []
    epoch = iter(feed.stream(train))
    seen.append([next(epoch) for _ in range(2)])  # an epoch cut short (limit_train_batches) ...
    seen.append(list(feed.stream(train)))  # ... and the next one, whole
    outer = iter(feed.stream(train))
    first = [next(outer) for _ in range(3)]
    seen.append(list(feed.stream(val)))  # validation inside a training epoch ...
    seen.append(first + list(outer))  # ... which then goes on to its end
    held = iter(feed.stream(other))
    seen.append([next(held)])
    del held  # abandoned: dropped at once, not at the next stream of its loader
    seen.append(list(feed.stream(val)))
    shared = iter(feed.stream(train, key="fit"))  # one loader for training and validation (fit(model, dl, dl))
    first = [next(shared)]
    seen.append(list(feed.stream(train, key="validate")))
    seen.append(first + list(shared))
    feed.close()
    expected = [_batches(6, 0)[:2], _batches(6, 0), _batches(2, 1), _batches(6, 0), _batches(5, 2)[:1], _batches(2, 1)]
    expected += [_batches(6, 0), _batches(6, 0)]
    return [len(s) for s in seen], _same(seen, expected)  # plain values: tensors would cross in shared memory


@pytest.mark.timeout(120)
def test_every_stage_gets_stage_zeros_batches_in_order() -> None:
    """Three stages: an epoch cut short then a whole one, validation inside an epoch that then goes on, an abandoned
    stream, one loader under two keys; only stage 0 iterates its loaders."""
    results = run_distributed(_feed_worker, 3, timeout=100)
    assert results == [([2, 6, 2, 6, 1, 2, 6, 6], True)] * 3


def _failing_worker(rank: int, world_size: int) -> str:
    from lightning_gpipe.pipe.comm.batch_feed import BatchFeed

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
