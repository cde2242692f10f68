"""Splitting a mini-batch into micro-batches and joining them back: structures, sizes, errors and exact gradients."""

from __future__ import annotations

import warnings
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

from lightning_gpipe.pipe.microbatch import (
    batch_size,
    join,
    micro_batch_sizes,
    micro_batch_weights,
    split,
    split_by_sizes,
)
from tests.helpers.models import D, make_input, mlp

pytestmark = pytest.mark.timeout(30)

Pair = namedtuple("Pair", ["left", "right"])


def nested_batch(n: int) -> dict:
    """Every kind of leaf a stage boundary may hold, batched or replicated."""
    g = torch.Generator().manual_seed(n)
    return {
        "x": torch.randn(n, 3, generator=g),
        "pair": Pair(torch.arange(n), [torch.randn(n, 2, 2, generator=g), None]),
        "tuple": (torch.rand(n, generator=g) > 0.5, "label", 7),
        "scale": torch.tensor(2.5),  # 0-dim: no batch dimension, replicated
        "none": None,
    }


def test_split_nested_structure() -> None:
    batch = nested_batch(10)
    micro = split(batch, 4)
    assert [batch_size(mb) for mb in micro] == [3, 3, 2, 2]
    start = 0
    for mb in micro:
        n = batch_size(mb)
        assert isinstance(mb["pair"], Pair)
        assert isinstance(mb["pair"].right, list)
        assert isinstance(mb["tuple"], tuple)
        assert torch.equal(mb["x"], batch["x"][start : start + n])
        assert torch.equal(mb["pair"].left, batch["pair"].left[start : start + n])
        assert torch.equal(mb["pair"].right[0], batch["pair"].right[0][start : start + n])
        assert torch.equal(mb["tuple"][0], batch["tuple"][0][start : start + n])
        # Non-tensors and 0-dim tensors are replicated, not split.
        assert mb["tuple"][1:] == ("label", 7)
        assert mb["pair"].right[1] is None and mb["none"] is None
        assert mb["scale"] is batch["scale"]
        start += n
    assert start == 10


def test_split_returns_views() -> None:
    # Micro-batches are views of the caller's batch: splitting must not copy activations.
    x = torch.randn(8, D)
    for mb in split(x, 4):
        assert mb.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("N", "chunks", "sizes"),
    [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (7, 1, [7]), (5, 5, [1] * 5), (3, 8, [1, 1, 1])],
)
def test_micro_batch_sizes(N: int, chunks: int, sizes: list[int]) -> None:
    assert micro_batch_sizes(N, chunks) == sizes
    # Same sizes as torch.tensor_split, which is what users of torchgpipe expect.
    assert [len(t) for t in torch.arange(N).tensor_split(min(N, chunks))] == sizes


def test_fewer_samples_than_chunks_warns_once() -> None:
    with pytest.warns(UserWarning, match="fewer than chunks") as record:
        micro = split(torch.randn(3, D), 8)
    assert len(record) == 1
    assert [mb.shape[0] for mb in micro] == [1, 1, 1]


def test_enough_samples_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split(torch.randn(8, D), 8)


def test_mismatched_batch_sizes() -> None:
    with pytest.raises(ValueError, match="disagree on the batch size"):
        split({"a": torch.randn(4, 2), "b": torch.randn(5, 2)}, 2)


def test_nothing_to_split() -> None:
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        split({"scale": torch.tensor(1.0), "name": "x"}, 2)


def test_bad_chunks_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="chunks"):
        micro_batch_sizes(4, 0)
    with pytest.raises(ValueError, match="empty batch"):
        micro_batch_sizes(0, 2)


@pytest.mark.parametrize(("N", "chunks"), [(10, 4), (8, 8), (1, 3), (9, 2)])
def test_join_inverts_split(N: int, chunks: int) -> None:
    batch = nested_batch(N)
    batch.pop("scale")  # a 0-dim leaf cannot be joined (see test_join_rejects_0_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N < chunks warns; covered above
        joined = join(split(batch, chunks))
    assert torch.equal(joined["x"], batch["x"])
    assert isinstance(joined["pair"], Pair)
    assert torch.equal(joined["pair"].left, batch["pair"].left)
    assert torch.equal(joined["pair"].right[0], batch["pair"].right[0])
    assert joined["pair"].right[1] is None
    assert torch.equal(joined["tuple"][0], batch["tuple"][0])
    assert joined["tuple"][1:] == ("label", 7)
    assert joined["none"] is None


def test_join_rejects_0_dim() -> None:
    with pytest.raises(ValueError, match="0-dim tensor"):
        join([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}])


def test_join_rejects_mismatched_structures() -> None:
    with pytest.raises(ValueError, match="micro-batch 1 has structure"):
        join([(torch.randn(2, 1), torch.randn(2, 1)), [torch.randn(2, 1), torch.randn(2, 1)]])
    with pytest.raises(ValueError, match="nothing to join"):
        join([])


def test_micro_batch_weights() -> None:
    assert micro_batch_weights([3, 3, 2, 2]) == pytest.approx([0.3, 0.3, 0.2, 0.2])
    assert micro_batch_weights([4]) == [1.0]
    assert sum(micro_batch_weights(micro_batch_sizes(97, 8))) == pytest.approx(1.0)


@pytest.mark.parametrize(("N", "chunks"), [(10, 4), (7, 3), (13, 5)])
def test_weighted_micro_batch_gradients_equal_full_batch(N: int, chunks: int) -> None:
    """GPipe's synchronous update is exact: weighted per-micro-batch mean losses give the full-batch gradient."""
    torch.manual_seed(0)
    model = mlp(L=4).double()  # float64: the comparison below is about the algebra, not rounding
    x, target = make_input("mlp", N).double(), make_input("mlp", N, seed=1).double()

    F.mse_loss(model(x), target).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    sizes = micro_batch_sizes(N, chunks)
    assert len(set(sizes)) > 1  # uneven: unweighted averaging would be wrong here
    micro = zip(split_by_sizes(x, sizes), split_by_sizes(target, sizes), micro_batch_weights(sizes))
    for mx, mt, w in micro:
        (w * F.mse_loss(model(mx), mt)).backward()
    for p, g in zip(model.parameters(), full):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ per-sample non-tensor items, the batch dimension
def test_per_sample_strings_are_split_with_their_samples() -> None:
    names = [f"s{i}" for i in range(7)]
    batch = {"x": torch.arange(7).unsqueeze(1), "names": names, "ids": tuple(range(100, 107))}
    micro = split(batch, 3)
    assert [mb["names"] for mb in micro] == [names[:3], names[3:5], names[5:]]
    assert [mb["ids"] for mb in micro] == [(100, 101, 102), (103, 104), (105, 106)]  # a tuple stays a tuple
    for mb in micro:
        assert [f"s{int(i)}" for i in mb["x"][:, 0]] == mb["names"]  # each string with its own sample
    joined = join(micro)
    assert joined["names"] == names and joined["ids"] == batch["ids"]
    assert torch.equal(joined["x"], batch["x"])


def test_other_non_tensor_values_are_replicated() -> None:
    batch = {
        "x": torch.randn(4, 2),
        "langs": ("en", "de", "fr"),  # length ≠ N (and ≠ every micro-batch's n: see the module docstring)
        "name": "wmt",
        "k": 3,
        "pair": Pair("a", "b"),  # a namedtuple is a record, not a sequence of samples
        "nested": [torch.randn(4), "tag"],  # holds a tensor: a structure, its string is replicated
    }
    micro = split(batch, 2)
    for mb in micro:
        assert mb["langs"] == ("en", "de", "fr") and mb["name"] == "wmt" and mb["k"] == 3
        assert mb["pair"] == Pair("a", "b") and mb["nested"][1] == "tag"
        assert mb["nested"][0].shape == (2,)
    joined = join(micro)
    assert joined["langs"] == ("en", "de", "fr") and joined["pair"] == Pair("a", "b") and joined["k"] == 3


def test_join_takes_per_sample_lists_only_when_every_micro_batch_has_one() -> None:
    # Micro-batches of 2 and 1 samples that each carry the same two labels: a constant, not per-sample.
    parts = [{"x": torch.zeros(2, 1), "labels": ["a", "b"]}, {"x": torch.zeros(1, 1), "labels": ["a", "b"]}]
    assert join(parts)["labels"] == ["a", "b"]
    # Sizes given explicitly: per-sample strings alone can be joined.
    assert join([["a", "b"], ["c"]], sizes=[2, 1]) == ["a", "b", "c"]


def test_split_and_join_along_batch_dim_1() -> None:
    x = torch.randn(5, 7, D)  # time-major (T, N, D)
    lengths = torch.arange(7).unsqueeze(0)  # (1, N)
    micro = split((x, lengths, [str(i) for i in range(7)]), 3, batch_dim=1)
    assert [mb[0].shape for mb in micro] == [(5, 3, D), (5, 2, D), (5, 2, D)]
    assert [mb[2] for mb in micro] == [["0", "1", "2"], ["3", "4"], ["5", "6"]]
    joined = join(micro, batch_dim=1)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], lengths)
    assert batch_size(x, batch_dim=1) == 7


def test_batch_dim_beyond_a_tensors_dims_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"batch_dim=1, but a tensor of shape \(7,\) has no dimension 1"):
        split((torch.randn(5, 7, D), torch.arange(7)), 2, batch_dim=1)
