"""GPipeStrategy(data_loading="first_stage"): stage 0 loads, the other stages train on its batches — the same run."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, STEPS, TOL, dataset, lightning_module, reference


class Counting(TensorDataset):
    """Counts the samples this process loaded; ``noise`` adds per-rank noise, as rank-seeded augmentation would."""

    def __init__(self, rank: int, noise: bool = False) -> None:
        super().__init__(*dataset().tensors)
        self.rank, self.noise, self.loaded = rank, noise, 0

    def __getitem__(self, i):
        self.loaded += 1
        x, y = super().__getitem__(i)
        if self.noise:
            x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(self.rank))
        return x, y


def fit_worker(rank: int, world_size: int, pp: int, hooked: bool) -> dict:
    import logging

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.strategies.gpipe").addHandler(handler)
    module = lightning_module(hooked=hooked)
    data = Counting(rank)
    strategy = GPipeStrategy(chunks=3, pipeline_parallel_size=pp, data_loading="first_stage")
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    expected = reference(world_size // pp, None)
    params = {n: p.detach().cpu() for n, p in module.named_parameters()}
    errors = [(p - expected[n]).abs().max() / expected[n].abs().max() for n, p in params.items()]
    said = [m for m in logged if "data_loading='first_stage'" in m]
    loaded, threads = data.loaded, _feed_threads()
    return {"max": float(max(errors)), "checked": len(errors), "loaded": loaded, "threads": threads, "said": said}


def _feed_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("gpipe-"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "pp", "hooked"), [(2, 2, False), (4, 2, True)])
def test_stage_zero_loads_and_the_run_is_the_plain_one(world_size: int, pp: int, hooked: bool) -> None:
    """pp = 2 (loss outside) and pp = 2 × dp = 2 (loss inside, each replica's own shard): weights equal the plain run;
    only stage 0 of each pipeline loaded samples (the other stages' datasets were never indexed)."""
    results = run_distributed(fit_worker, world_size, pp, hooked, timeout=280, lightning=True)
    dp = world_size // pp
    for rank, r in enumerate(results):
        assert r["max"] <= TOL, (rank, r)
        assert r["checked"] > 4, (rank, r)
        # Stage 0 loads STEPS batches of its shard (plus at most the feed's depth ahead); the others nothing.
        loaded = r["loaded"]
        assert (STEPS * BATCH <= loaded <= (STEPS + 3) * BATCH) if rank % pp == 0 else loaded == 0, (rank, loaded, dp)
        assert r["threads"] == [], (rank, r["threads"])  # the feed's threads ended with the fit
    assert results[0]["said"] == [
        "GPipeStrategy: each pipeline's batches are loaded once, on its stage 0 (up to two ahead), and sent to its "
        "1 other stage(s) (data_loading='first_stage')"
    ]
    assert all(r["said"] == [] for r in results[1:])  # rank 0 says it, once


def habits_worker(rank: int, world_size: int, same_loader: bool) -> dict:
    """Per-rank augmentation, validations inside each epoch that then goes on, epochs cut short by
    limit_train_batches."""
    import lightning.pytorch as pl

    from lightning_gpipe.strategy import GPipeStrategy
    from tests.helpers.tiny_fit import TinyPipelined

    warnings.simplefilter("ignore")

    class Recording(TinyPipelined):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[float] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(float(batch[0].double().sum()))
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.seen.append(-float(batch[0].double().sum()))
            self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

        def predict_step(self, batch, batch_idx):
            self.seen.append(float(batch[0].double().sum()) + 1000.0)
            return self(batch[0])

        def forward(self, x):
            return self.head(self.backbone(self.prefix(x)))

    module = Recording()
    strategy = GPipeStrategy(chunks=2, data_loading="first_stage", check_batches="always")
    trainer = quiet_trainer(
        devices=world_size,
        strategy=strategy,
        max_epochs=2,
        limit_train_batches=7,  # of 8: each epoch stops one short
        limit_val_batches=2,
        val_check_interval=3,
    )
    assert isinstance(trainer, pl.Trainer)
    loader = DataLoader(Counting(rank, noise=True), batch_size=BATCH, num_workers=1)
    trainer.fit(module, loader, loader if same_loader else DataLoader(Counting(rank), batch_size=BATCH))
    result = {"seen": list(module.seen), "val_loss": float(trainer.callback_metrics["val_loss"])}
    # Then the other loops, each with a feed of its own on the same group: validate, and predict (stage 0 returns).
    validated = trainer.validate(module, DataLoader(Counting(rank, noise=True), batch_size=BATCH), verbose=False)
    predicted = trainer.predict(module, DataLoader(Counting(rank, noise=True), batch_size=BATCH))
    rows = None if predicted is None else [row.tolist() for out in predicted for row in out]
    return result | {"validated": validated, "predicted": rows, "after_fit": module.seen, "threads": _feed_threads()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("same_loader", [False, True], ids=["own val loader", "fit(model, dl, dl)"])
def test_lightning_habits_see_stage_zeros_batches(same_loader: bool) -> None:
    """Rank-seeded augmentation in a worker would fail the batch check with every stage loading; here every stage
    trains and validates on stage 0's batches, in the same order, across epochs that stop early."""
    stage0, stage1 = run_distributed(habits_worker, 2, same_loader, timeout=280, lightning=True)
    # The sanity check, then per epoch 7 steps with a validation after steps 3 and 6 (of 2 batches each).
    assert len(stage0["seen"]) == 2 + 2 * (7 + 2 * 2)
    assert stage0["seen"] == stage1["seen"]
    assert stage0["val_loss"] == stage1["val_loss"]
    assert stage0["validated"] == stage1["validated"]  # on stage 0's noisy batches: the same loss on both
    assert stage0["after_fit"] == stage1["after_fit"]  # and the same batches through validate and predict
    assert len(stage0["predicted"]) == 48 and stage1["predicted"] is None  # returned once, by stage 0
    assert stage0["threads"] == stage1["threads"] == []


def failing_worker(rank: int, world_size: int) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")

    class Corrupt(TensorDataset):
        def __getitem__(self, i):
            if i == 20:
                raise OSError("image 20 is corrupt")
            return super().__getitem__(i)

    trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=2, data_loading="first_stage"))
    try:
        trainer.fit(lightning_module(), DataLoader(Corrupt(*dataset().tensors), batch_size=BATCH))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(200)
def test_a_loader_error_on_stage_zero_stops_every_stage() -> None:
    stage0, stage1 = run_distributed(failing_worker, 2, timeout=180, lightning=True)
    assert stage0 == "OSError: image 20 is corrupt", stage0
    assert "stage 0's data loader raised OSError: image 20 is corrupt" in stage1, stage1


def test_unknown_data_loading_is_refused() -> None:
    from lightning_gpipe.strategy import GPipeStrategy

    with pytest.raises(ValueError, match=r"data_loading='every_rank'.*'first_stage'"):
        GPipeStrategy(data_loading="every_rank")  # type: ignore[arg-type]
