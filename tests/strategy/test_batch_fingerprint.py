"""The batch fingerprint that GPipeStrategy compares across stages (exact under any thread count, yet sensitive), and
GPipeStrategy(check_batches=...): when the stages compare it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.strategy._batches import batch_fingerprint
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module


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


EPOCHS, STEPS_PER_EPOCH = 2, 3


def check_batches_worker(rank: int, world_size: int, when: str) -> dict:
    from lightning_gpipe.strategy import GPipeStrategy, _batches

    warnings.simplefilter("ignore")
    checks = []
    check_same_batch = _batches.check_same_batch

    def counted(*args, **kwargs):  # each call is one all-gather over the pipeline
        checks.append(1)
        return check_same_batch(*args, **kwargs)

    _batches.check_same_batch = counted

    class LaterBatchesDiffer(TensorDataset):
        def __getitem__(self, i):  # the first batch of every epoch is the same on both stages, later ones are not
            x, y = super().__getitem__(i)
            return (x + rank if i >= BATCH else x), y

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, check_batches=when),
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        use_distributed_sampler=False,  # one replica: every epoch reads samples 0, 1, ... in order
    )
    try:
        trainer.fit(lightning_module(), DataLoader(LaterBatchesDiffer(*dataset().tensors), batch_size=BATCH))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "checks": len(checks)}
    return {"error": None, "checks": len(checks)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("when", "checks"), [("first", EPOCHS), ("never", 0)])
def test_later_differences_go_unchecked_unless_asked(when: str, checks: int) -> None:
    """ "first": the first training step of each epoch only, so a batch differing later in the epoch is not compared
    (no collective there); "never": none at all."""
    for result in run_distributed(check_batches_worker, 2, when, timeout=280, lightning=True):
        assert result == {"error": None, "checks": checks}, result


@pytest.mark.timeout(150)
def test_always_compares_every_step_and_fails_clearly() -> None:
    for result in run_distributed(check_batches_worker, 2, "always", timeout=130, lightning=True):
        message = result["error"]
        assert message is not None and "different batch than stage 0" in message and "seed" in message, result
        assert result["checks"] == 2, result  # the first batch passed, the second differed
