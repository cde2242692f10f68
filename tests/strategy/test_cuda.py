"""On a CUDA device (skipped without one): the engine and GPipeStrategy on one GPU, under every precision."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_gpipe.pipe import GPipeStage
from tests.helpers import models
from tests.helpers.launch import quiet_trainer
from tests.helpers.stage_models import attention_grads
from tests.helpers.tiny_fit import BATCH, TinyPipelined, dataset

# CI has no GPU; these run where one is lent (the project's GPU sessions run them on an H100).
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_fp32() -> None:
    # TF32 would round fp32 matmuls and convolutions to 10-bit mantissas: no 1e-6 parity with it.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_engine_on_one_gpu_equals_the_plain_model(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = models.mlp().cuda()
    x, y = torch.randn(10, models.D, device="cuda"), torch.randn(10, models.D, device="cuda")
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    stage = GPipeStage(model, chunks=4, checkpoint=checkpoint, device="cuda", timeline=True)
    F.mse_loss(stage(x), y).backward()
    stage.backward()
    for (name, p), q in zip(stage.named_parameters(), plain.parameters()):
        assert p.grad.device.type == "cuda"
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 1e-6, name
    kinds = {e.kind for e in stage.timeline.events}
    assert {"forward", "backward"} <= kinds


class Devices(pl.Callback):
    """The device types of the module's parameters at every training step."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.seen |= {p.device.type for p in module.parameters()}


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_strategy_on_one_gpu(precision: str, tmp_path: Path) -> None:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = TinyPipelined()
    strategy = GPipeStrategy(chunks=3, trace_dir=str(tmp_path), trace_steps=[1])
    devices = Devices()
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_steps=3, precision=precision, callbacks=[devices]
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    # Lightning's teardown moves the module back to the CPU after fit, as it does under DDP: look during training.
    assert devices.seen == {"cuda"}, devices.seen
    assert (tmp_path / "step_1.png").exists() and (tmp_path / "step_1.json").exists()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_examples_run_on_one_gpu(precision: str, tmp_path: Path) -> None:
    """Both example tasks, a few steps each on generated data, pipelined on one GPU (issue: bf16/16-mixed)."""
    from examples.amoebanet.classifier import ImageClassifier
    from examples.amoebanet.data import ImageClassificationData
    from examples.nmt.data.translation import TranslationData
    from examples.nmt.translator import Translator
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    images = ImageClassificationData(
        source="generated", image_size=32, num_classes=10, train_size=64, val_size=32, batch_size=16, num_workers=0
    )
    classifier = ImageClassifier(num_classes=10, num_layers=3, num_filters=16)
    text = TranslationData(
        source="generated",
        train_size=256,
        val_size=16,
        batch_size=16,
        vocab_size=300,
        num_workers=0,
        cache_dir=str(tmp_path / "vocab"),
    )
    translator = Translator(
        vocab_size=text.vocab_size,
        max_len=text.max_len,
        num_layers=1,
        ffn_dim=64,
        num_heads=2,
        d_model=32,
        warmup_steps=2,
    )
    for module, data in ((classifier, images), (translator, text)):
        trainer = quiet_trainer(
            accelerator="gpu",
            devices=1,
            strategy=GPipeStrategy(chunks=4),
            precision=precision,
            max_steps=3,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            val_check_interval=3,
        )
        trainer.fit(module, datamodule=data)
        assert torch.isfinite(trainer.callback_metrics["train_loss"]), type(module).__name__


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_loss_inside_on_one_gpu_equals_the_plain_model(schedule: str) -> None:
    """forward_backward's loss per micro-batch on a GPU (K = 1, uneven micro-batches): the plain model's gradients."""
    torch.manual_seed(0)
    model = models.mlp().cuda()
    x, y = torch.randn(11, models.D, device="cuda"), torch.randn(11, models.D, device="cuda")
    plain = copy.deepcopy(model)
    F.mse_loss(plain(x), y).backward()
    stage = GPipeStage(model, chunks=4, device="cuda")
    sizes, starts = [3, 3, 3, 2], [0, 3, 6, 9]

    def loss(out: torch.Tensor, m: int) -> torch.Tensor:
        return F.mse_loss(out, y[starts[m] : starts[m] + sizes[m]]) * sizes[m] / len(x)

    stage.forward_backward(x, loss, schedule=schedule)
    for (name, p), q in zip(stage.named_parameters(), plain.parameters()):
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() <= 1e-6, name


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_zb_h1_trains_as_1f1b_does_on_one_gpu(precision: str) -> None:
    """The deferred weight gradients on a GPU under every precision (16-mixed: with its GradScaler): 1F1B's weights."""
    from lightning_gpipe.strategy import GPipeStrategy
    from tests.helpers.tiny_fit import TinyHooked

    warnings.simplefilter("ignore")
    weights = {}
    for schedule in ("1f1b", "zb-h1"):
        module = TinyHooked()
        strategy = GPipeStrategy(chunks=4, schedule=schedule)
        trainer = quiet_trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=4)
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
        weights[schedule] = {n: p.detach().cpu() for n, p in module.named_parameters()}
    assert len(weights["zb-h1"]) > 4
    for name, w in weights["1f1b"].items():
        assert torch.equal(weights["zb-h1"][name], w), name


def test_rematerialization_lowers_the_gpu_memory_peak() -> None:
    """checkpoint="always" keeps only the boundary activations of each micro-batch: a lower peak than "never"."""
    torch.manual_seed(0)
    x = torch.randn(2048, 1024, device="cuda")  # activations (16 of 8 MB) outweigh the gradients (32 MB)
    peaks = {}
    for checkpoint in ("never", "always"):
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh()) for _ in range(8)]
        )
        stage = GPipeStage(model.cuda(), chunks=4, checkpoint=checkpoint, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stage(x).square().mean().backward()
        stage.backward()
        torch.cuda.synchronize()
        peaks[checkpoint] = torch.cuda.max_memory_allocated() - base
    assert peaks["always"] < 0.7 * peaks["never"], peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_repeats_the_forward_of_attention_with_dropout_on_the_gpu(dtype: torch.dtype) -> None:
    """The forward phase of a checkpointed micro-batch runs in the recompute's grad mode (``discarded_graph``), so
    PyTorch picks the same attention kernel both times, and with it the same dropout stream."""
    never, always = attention_grads("never", "cuda", dtype), attention_grads("always", "cuda", dtype)
    for name in never:
        assert torch.equal(never[name], always[name]), name


def syncs(caught: list[warnings.WarningMessage]) -> list[str]:
    """The synchronizing operations among the warnings, without the notice that the debug mode is a prototype (torch
    warns it once per process, at the first ``set_sync_debug_mode("warn")``: seen on an H200 in the first M's count)."""
    messages = [str(w.message) for w in caught]
    return [m for m in messages if "synchroniz" in m and not m.startswith("Synchronization debug mode is a prototype")]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_device_syncs_per_step_do_not_grow_with_M(schedule: str) -> None:
    """The engine's loss-inside step under torch.cuda.set_sync_debug_mode("warn"): as many syncs at M = 8 as at 2."""
    torch.manual_seed(0)
    x, y = torch.randn(16, models.D, device="cuda"), torch.randn(16, models.D, device="cuda")
    counts = {}
    for M in (2, 8):
        stage = GPipeStage(models.mlp().cuda(), chunks=M, device="cuda")
        sizes = stage.micro_batch_sizes(x)
        starts = [sum(sizes[:m]) for m in range(M)]

        def loss(out: torch.Tensor, m: int, starts: list[int] = starts, sizes: list[int] = sizes) -> torch.Tensor:
            return F.mse_loss(out, y[starts[m] : starts[m] + sizes[m]], reduction="sum") / len(x)

        stage.forward_backward(x, loss, schedule=schedule)  # warm-up: first-call allocations
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stage.forward_backward(x, loss, schedule=schedule)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[M] = syncs(caught)
    assert len(counts[2]) == len(counts[8]), counts


def test_strategy_syncs_per_step_do_not_grow_with_M() -> None:
    """A GPipeStrategy step with the loss inside and values logged per micro-batch, M = 2 and 6, on one GPU."""
    from lightning_gpipe.strategy import GPipeStrategy
    from tests.helpers.tiny_fit import Logged

    class SyncsPerStep(pl.Callback):
        def __init__(self) -> None:
            self.counts: list[int] = []
            self.caught: Any = None

        def on_train_batch_start(self, *args: Any) -> None:
            self.caught = warnings.catch_warnings(record=True)
            self.records = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(None, None, None)
            self.counts.append(len(syncs(self.records)))

    counts = {}
    for M in (2, 6):
        counter = SyncsPerStep()
        trainer = quiet_trainer(
            accelerator="gpu", devices=1, strategy=GPipeStrategy(chunks=M), max_steps=3, callbacks=[counter]
        )
        trainer.fit(Logged(), DataLoader(dataset(), batch_size=12))
        counts[M] = counter.counts[-1]
    assert counts[2] == counts[6], counts


def test_compiled_layers_on_one_gpu_equal_the_eager_pipeline() -> None:
    """Inductor on CUDA, float64: residual conv-BatchNorm blocks with dropout, every micro-batch recomputed, give the
    eager pipeline's gradients and deferred running statistics (inductor's dropout is not eager's: the reference is
    the compiled pipeline without a recompute), in one graph a layer class."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.drop = nn.Dropout(0.2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(torch.relu(self.bn(self.conv(x))))

    torch.manual_seed(0)
    plain = nn.Sequential(*(Block() for _ in range(3))).double().cuda()
    got = []
    for mode in ("always", "never"):
        stage = GPipeStage(copy.deepcopy(plain), chunks=3, checkpoint=mode, device="cuda", compile=True)
        for step, n in enumerate([8, 7, 9]):
            torch.manual_seed(step)
            stage(torch.randn(n, 8, 6, 6, device="cuda", dtype=torch.float64)).square().mean().backward()
            stage.backward()
        got.append((stage, [p.grad for p in stage.parameters()], list(stage.buffers())))
        assert all(n <= 1 for n in stage.compilations.values()), stage.compilations  # the second: the first's
    (_, grads, buffers), (_, ref_grads, ref_buffers) = got
    for g, r in zip(grads + buffers, ref_grads + ref_buffers):
        assert ((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item() <= 1e-9
