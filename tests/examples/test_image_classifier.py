"""ImageClassifier (AmoebaNet-D recipe): pipelined training equals a plain run; fine-tuning swaps the classifier.

The parity runs in float64 ("64-true"): in float32 this model's BatchNorm-over-tiny-micro-batches gradients sit on
a noise floor — two plain single-process runs, one with 1 thread and one with 2, already differ by 6e-5 after one
step (the BN biases' gradients are sums that nearly cancel) — so float32 cannot tell a pipeline bug from roundoff.
At 32 px the last cells see 1×1 maps, and BatchNorm over 2 values amplifies even float64 roundoff; 64 px avoids it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, TensorDataset

from examples.amoebanet.classifier import ImageClassifier
from examples.optim import decay_groups, inverse_sqrt, warmup_then_decay
from lightning_gpipe.pipe import micro_batch_sizes
from lightning_gpipe.strategy._materialize import materialize, record_init
from tests.helpers.launch import quiet_trainer, run_distributed

CHUNKS, BATCH, STEPS, SEED = 3, 7, 3, 7  # batches of 7 in 3 micro-batches: 3, 2, 2 (uneven)
SIDE, PRECISION = 64, "64-true"
TINY = {"num_classes": 4, "num_layers": 3, "num_filters": 8, "lr": 0.05, "lr_batch_size": 7, "rmsprop_eps": 1e-3}
TINY_SCHEDULE = {"warmup_epochs": 0.4, "lr_decay": 0.5, "lr_decay_epochs": 0.5, "weight_decay": 1e-2}


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    n = BATCH * STEPS
    return TensorDataset(torch.randn(n, 3, SIDE, SIDE, generator=g), torch.randint(0, 4, (n,), generator=g))


def loader() -> DataLoader:
    return DataLoader(images(), batch_size=BATCH)


def batch_norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class PlainMicroBatched(ImageClassifier):
    """The reference: one process, no pipeline, but what GPipe computes — each micro-batch normalized with its own
    statistics, the loss the mean over the whole batch, running statistics updated once from the whole batch."""

    def configure_model(self) -> None:
        if self.backbone is None:
            with torch.device("meta"), record_init() as record:  # as GPipeStrategy.model_sharded_context does
                super().configure_model()
            # The same initialization GPipeStrategy gives a model built on the meta device (seeded by module name).
            materialize(self, dict(self.named_modules()), torch.device("cpu"), SEED, record)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        assert self.backbone is not None
        bns = batch_norms(self.backbone)
        seen: dict[nn.Module, list[Tensor]] = {bn: [] for bn in bns}
        hooks = [bn.register_forward_pre_hook(lambda m, a: seen[m].append(a[0].detach())) for bn in bns]
        saved = [(bn.momentum, bn.num_batches_tracked.clone()) for bn in bns]
        for bn in bns:
            bn.momentum = 0.0  # normalize with micro-batch statistics, but leave the running statistics alone
        sizes = micro_batch_sizes(len(x), CHUNKS)
        smoothing = self.hparams.label_smoothing
        losses = [
            F.cross_entropy(self.backbone(xm), ym, label_smoothing=smoothing) * len(xm)
            for xm, ym in zip(x.split(sizes), y.split(sizes), strict=True)
        ]
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for bn, (momentum, tracked) in zip(bns, saved, strict=True):
                bn.momentum = momentum
                bn.num_batches_tracked.copy_(tracked)
                bn(torch.cat(seen[bn]))  # nn.BatchNorm on the whole mini-batch: what deferred BatchNorm commits
        return torch.stack(losses).sum() / len(x)


def numpy_state(module: nn.Module) -> dict[str, Any]:
    # numpy, not tensors: a queue passes tensors as shared memory, which a finished worker takes with it.
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def fit_pipelined(rank: int, world_size: int, workdir: str, optimizer: str) -> dict[str, Any]:
    """K = 2, M = 3: train, save a checkpoint, then fine-tune from it to 3 classes."""
    import lightning.pytorch as pl

    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    pl.seed_everything(SEED)
    module = ImageClassifier(**TINY, **TINY_SCHEDULE, optimizer=optimizer)  # type: ignore[arg-type]
    trainer = quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(chunks=CHUNKS),
        max_steps=STEPS,
        use_distributed_sampler=False,
        precision=PRECISION,
    )
    trainer.fit(module, loader())
    trained = numpy_state(module)
    checkpoint = Path(workdir) / "pretrained"
    trainer.save_checkpoint(checkpoint)

    class Capture(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.state = numpy_state(pl_module)

    capture = Capture()
    tuned = ImageClassifier(**{**TINY, "num_classes": 3}, pretrained=str(checkpoint))
    trainer = quiet_trainer(
        devices=2, strategy=GPipeStrategy(chunks=CHUNKS), max_steps=1, callbacks=[capture], precision=PRECISION
    )
    trainer.fit(tuned, DataLoader(TensorDataset(images().tensors[0], images().tensors[1] % 3), batch_size=BATCH))
    return {"stage": trainer.strategy.stage.index, "trained": trained, "fine_tune_start": capture.state}


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["rmsprop", "lars"])
def test_pipelined_recipe_equals_plain_run_and_fine_tunes(tmp_path: Path, optimizer: str) -> None:
    """LARS: each layer's trust ratio ‖w‖/‖∇w‖ is over the whole parameter, which one stage holds whole (and a
    copy on another stage gets the summed gradient), so the pipelined run equals the plain one."""
    per_rank = run_distributed(fit_pipelined, 2, str(tmp_path), optimizer, timeout=280, lightning=True)
    for rank in per_rank:
        for part in ("trained", "fine_tune_start"):
            rank[part] = {k: torch.from_numpy(v) for k, v in rank[part].items()}

    torch.manual_seed(SEED)
    plain = PlainMicroBatched(**TINY, **TINY_SCHEDULE, optimizer=optimizer)  # type: ignore[arg-type]
    quiet_trainer(devices=1, max_steps=STEPS, precision=PRECISION).fit(plain, loader())
    expected = plain.state_dict()

    held = [k for r in per_rank for k in r["trained"]]
    assert sorted(set(held)) == sorted(expected), "the stages together hold the plain module's state"
    stats = [k for k in expected if "running_" in k]
    assert stats and all(k in held for k in stats)
    for rank in per_rank:
        for key, value in rank["trained"].items():
            if value.is_floating_point():
                assert rel_err(value, expected[key]) <= 1e-6, (rank["stage"], key, rel_err(value, expected[key]))
            else:
                assert torch.equal(value, expected[key]), key
    # Fine-tuning: every weight but the classifier's from the checkpoint, a new 3-way classifier.
    last = next(r for r in per_rank if "backbone.classifier.fc.weight" in r["fine_tune_start"])
    assert last["fine_tune_start"]["backbone.classifier.fc.weight"].shape[0] == 3
    assert last["trained"]["backbone.classifier.fc.weight"].shape[0] == 4
    for rank in per_rank:
        start, trained = rank["fine_tune_start"], rank["trained"]
        kept = [k for k in start if not k.startswith("backbone.classifier.")]
        assert kept and all(torch.equal(start[k], trained[k]) for k in kept)


@pytest.mark.timeout(120)
def test_pretrained_of_another_architecture_is_named(tmp_path: Path) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    trainer = quiet_trainer(devices=1, max_steps=1)
    trainer.fit(ImageClassifier(**TINY), loader())
    trainer.save_checkpoint(tmp_path / "small.ckpt")
    wider = ImageClassifier(**{**TINY, "num_filters": 12}, pretrained=str(tmp_path / "small.ckpt"))
    with pytest.raises(ValueError, match=r"does not fit this model.*checkpoint's architecture"):
        quiet_trainer(devices=1, max_steps=1).fit(wider, loader())
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ImageClassifier(pretrained=str(tmp_path / "missing.ckpt"))


def test_no_weight_decay_on_norms_and_biases() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2), nn.LayerNorm(2))
    net(torch.randn(2, 3, 5, 5))
    decayed, free = decay_groups(net, 0.1)
    assert decayed["weight_decay"] == 0.1 and free["weight_decay"] == 0.0
    assert {id(p) for p in decayed["params"]} == {id(net[0].weight), id(net[3].weight)}
    assert len(free["params"]) == 6  # conv bias, BN weight and bias, linear bias, LayerNorm weight and bias


def test_learning_rate_schedules() -> None:
    smooth, stairs = warmup_then_decay(4, 0.5, 2.0, "exponential"), warmup_then_decay(4, 0.5, 2.0, "step")
    assert [smooth(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert smooth(4) == 1.0 and smooth(6) == 0.5 and smooth(5) == pytest.approx(0.5**0.5)
    assert stairs(5) == 1.0 and stairs(6) == 0.5 and stairs(9) == 0.25
    assert warmup_then_decay(0, 0.5, 1.0, "constant")(100) == 1.0
    rsqrt = inverse_sqrt(4)
    assert rsqrt(3) == 1.0 and rsqrt(15) == pytest.approx(0.5) and rsqrt(0) == 0.25
    with pytest.raises(ValueError, match="decay_steps"):
        warmup_then_decay(1, 0.5, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "adam"}, "choose 'rmsprop', 'lars' or 'sgd'"),
        ({"lr_schedule": "cosine"}, "choose 'exponential', 'step' or 'constant'"),
        ({"num_layers": 4}, "multiple of 3"),
    ],
)
def test_bad_arguments_are_named_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageClassifier(**kwargs)


def test_batch_shape_gives_an_example_input_that_holds_no_memory() -> None:
    """The CLI links the data's batch shape: GPipeStrategy's balance="auto" then counts FLOPs on it."""
    assert ImageClassifier(**TINY).example_input_array is None
    example = ImageClassifier(**TINY, batch_shape=[64, 3, 32, 32]).example_input_array
    assert isinstance(example, Tensor) and example.shape == (64, 3, 32, 32) and not example.any()
    assert example.untyped_storage().nbytes() == example.element_size()  # one zero, expanded


def fit_loss_scaled(rank: int, world_size: int) -> dict[str, Any]:
    """K = 2, M = 3, LARS with warm-up and no decay on norms and biases, under 16-mixed's loss scaling."""
    import lightning.pytorch as pl

    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    torch.set_default_dtype(torch.float64)  # see test_16_mixed_lars_recipe_equals_plain_run
    pl.seed_everything(SEED)
    module = ImageClassifier(**TINY, **TINY_SCHEDULE, optimizer="lars")
    trainer = quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(chunks=CHUNKS),
        max_steps=STEPS,
        use_distributed_sampler=False,
        plugins=[_fp16_plugin()],
    )
    trainer.fit(module, loader())
    scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
    sharded = isinstance(scaler, ShardedGradScaler)  # agrees on found_inf over the world
    return {"state": numpy_state(module), "sharded_scaler": sharded, "scale": float(scaler.get_scale())}


def _fp16_plugin() -> Any:
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu")  # Trainer(precision="16-mixed") is refused on a CPU


@pytest.mark.timeout(300)
def test_16_mixed_lars_recipe_equals_plain_run() -> None:
    """Issue 16's large-batch recipe — 16-mixed + timm's LARS + warm-up + no decay on BN/bias — pipelined and on one
    device. Parameters in float64 (autocast leaves float64 alone) isolate what the pipeline adds to mixed
    precision: the loss scaling (one GradScaler decision for all stages: ShardedGradScaler), unscaling before
    LARS's trust ratio, and the trust ratio over each whole parameter. fp16's own rounding is autocast's, the same
    with or without a pipeline; in float32 it sits on this model's BatchNorm noise floor (module docstring)."""
    per_rank = run_distributed(fit_loss_scaled, 2, timeout=280, lightning=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(SEED)
        plain = PlainMicroBatched(**TINY, **TINY_SCHEDULE, optimizer="lars")
        start = StartState()
        trainer = quiet_trainer(devices=1, max_steps=STEPS, plugins=[_fp16_plugin()], callbacks=[start])
        trainer.fit(plain, loader())
    finally:
        torch.set_default_dtype(previous)
    expected = plain.state_dict()
    plain_scale = float(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]
    assert sorted({k for r in per_rank for k in r["state"]}) == sorted(expected)
    for rank in per_rank:
        assert rank["sharded_scaler"] and rank["scale"] == plain_scale, rank["scale"]
        for key, value in rank["state"].items():
            value = torch.from_numpy(value)
            assert value.dtype == expected[key].dtype, key
            if value.is_floating_point():
                assert rel_err(value, expected[key]) <= 1e-9, (key, rel_err(value, expected[key]))
            else:
                assert torch.equal(value, expected[key]), key
    assert all(not torch.equal(expected[k], start.state[k]) for k in expected if k.endswith("weight")), "it trained"


class StartState(pl.Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
