"""The batch fingerprint that GPipeStrategy compares across stages: exact under any thread count, yet sensitive."""

from __future__ import annotations

import pytest
import torch

from lightning_gpipe.strategy._arguments import batch_fingerprint


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def test_the_same_under_any_thread_count(threads) -> None:
    """A float sum is not: its reduction order follows the thread count (ranks started by Lightning differ)."""
    x, y = images()
    big = torch.randn(5_000_000, 1, generator=torch.Generator().manual_seed(1))  # the chunked weighted sum
    seen = set()
    for n in (1, 2, 3):
        threads(n)
        seen.add((batch_fingerprint((x, y)), batch_fingerprint(big)))
    assert len(seen) == 1


def test_every_change_of_content_order_shape_or_dtype_changes_it() -> None:
    x, y = images()
    base = batch_fingerprint((x, y))
    one_ulp = x.clone()
    one_ulp[5, 1, 10, 10] = torch.nextafter(one_ulp[5, 1, 10, 10], torch.tensor(10.0))
    swapped = y.clone()
    swapped[0], swapped[1] = y[1].item(), y[0].item()
    assert y[0] != y[1]
    variants = {
        "one ulp": (one_ulp, y),
        "horizontal flip": (x.flip(-1), y),
        "vertical flip": (x.flip(-2), y),
        "samples reordered": (x[[1, 0, *range(2, 64)]], y),
        "two labels swapped": (x, swapped),
        "float64": (x.double(), y),
        "reshaped": (x.reshape(64, 3, 16, 64), y),
        "one leaf more": (x, y, torch.zeros(())),
    }
    for name, batch in variants.items():
        assert batch_fingerprint(batch) != base, name


@pytest.mark.parametrize(
    "leaf",
    [
        torch.tensor(True),
        torch.zeros(3, dtype=torch.bool),
        torch.arange(20, dtype=torch.uint8).reshape(4, 5),
        torch.ones(2, 3, dtype=torch.complex64),
        torch.ones(4, 3, dtype=torch.float16),
        torch.ones(4, 4, dtype=torch.bfloat16),
        torch.tensor(3.5),
        torch.empty(3, 0),
        torch.arange(10).t(),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    ],
    ids=str,
)
def test_any_leaf_is_fingerprinted(leaf: torch.Tensor) -> None:
    value = batch_fingerprint({"leaf": leaf, "other": [1, "text"]})
    assert 0 <= value < 2**63
    assert batch_fingerprint({"leaf": leaf.clone()}) == batch_fingerprint({"leaf": leaf})
