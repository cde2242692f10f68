"""GPipeStrategy: a pipelined Trainer run is the same run as a plain single-process one (pp, pp × dp)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import (
    BATCH,
    STEPS,
    TOL,
    dataset,
    lightning_module,
    reference,
)


def fit_worker(
    rank: int, world_size: int, pp: int, chunks: int, clip: float | None, tied: bool = False
) -> dict[str, float]:

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module(tied=tied)
    strategy = GPipeStrategy(chunks=chunks, pipeline_parallel_size=pp, backbone="backbone")
    trainer = quiet_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=clip,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(world_size // pp, clip, tied)
    errors = {}
    for name, p in module.named_parameters():  # this stage's layers, under their global names, and the replicas
        ref = expected[name]
        errors[name] = ((p.detach().cpu() - ref).abs().max() / ref.abs().max()).item()
    loss = float(trainer.callback_metrics["train_loss"])
    return {"max": max(errors.values()), "errors": errors, "checked": len(errors), "loss": loss}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "pp", "chunks", "clip", "tied"),
    [(2, 2, 4, None, False), (2, 2, 3, 0.05, False), (4, 2, 4, 0.05, False), (2, 2, 4, 0.05, True)],
)
def test_fit_equals_plain_training(world_size: int, pp: int, chunks: int, clip: float | None, tied: bool) -> None:
    """pp = 2; pp = 2 × dp = 2 with different data per replica; clipping; a weight tied across first and last stage."""
    results = run_distributed(fit_worker, world_size, pp, chunks, clip, tied, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["max"] <= TOL, (rank, r)
        assert r["checked"] > 4, (rank, r)  # replicated prefix/head plus this stage's layers
    assert len({r["loss"] for r in results[:pp]}) == 1  # every stage of a pipeline logged the same value


def different_batch_worker(rank: int, world_size: int) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")

    class Augmenting(TensorDataset):
        def __getitem__(self, i):  # noise drawn per rank: the two stages would train on different inputs
            x, y = super().__getitem__(i)
            return x + torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)), y

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2),
        max_steps=2,
    )
    try:
        trainer.fit(lightning_module(), DataLoader(Augmenting(*dataset().tensors), batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
def test_stages_given_different_batches_fail_clearly() -> None:
    for message in run_distributed(different_batch_worker, 2, timeout=100, lightning=True):
        assert "different batch than stage 0" in message and "seed" in message, message
