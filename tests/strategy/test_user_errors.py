"""Mistakes new users make, each stopped with its cause and its fix: the batch dimension, backbones that are not a
sequence of layers, the model's own checkpointing, several backbone calls per step; and the split table's shares."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_gpipe.pipe.microbatch import split_by_sizes
from lightning_gpipe.pipe.split.indexing import RemoteLayer
from lightning_gpipe.strategy._arguments import check_backbone_layers, find_backbone
from lightning_gpipe.strategy._audit import check_split_dim
from lightning_gpipe.strategy._balance import Plan
from lightning_gpipe.strategy._partition_report import PartitionReport, WholeModel
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

D, V, T, N = 8, 11, 5, 8


# --------------------------------------------------------------------------------------- the batch dimension
def test_a_split_across_the_samples_stops_with_batch_dim() -> None:
    tokens, labels = torch.zeros(T, N, dtype=torch.long), torch.zeros(N, dtype=torch.long)  # pad_sequence's default
    hidden = torch.zeros(T, N, D)
    with pytest.raises(ValueError, match=r"holds 8 samples \(a tensor of shape \(8,\)\).*batch_dim=1\)"):
        check_split_dim(hidden, (tokens, labels), 0, "backbone")
    # A time-major backbone fed batch-first batches (the transpose is in training_step).
    with pytest.raises(ValueError, match=r"a tensor of shape \(8, 5, 8\)\), which the input holds along dim 1"):
        check_split_dim(hidden, (torch.zeros(N, T, D), labels), 0, "backbone")
    # Told so, both layouts of the loader are fine.
    assert check_split_dim(hidden, (tokens, labels), 1, "backbone") is None
    assert check_split_dim(hidden, (torch.zeros(N, T, D), labels), 1, "backbone") is None


def test_what_is_legitimate_still_passes() -> None:
    x, y = torch.zeros(N, D), torch.zeros(N)
    vocabulary_mask, scale = torch.ones(V, dtype=torch.bool), torch.tensor(2.0)
    assert check_split_dim(torch.zeros(N, D), (x, y, vocabulary_mask, scale, "name"), 0, "backbone") is None
    assert check_split_dim((torch.zeros(N, T, D), torch.ones(N, T)), {"ids": torch.zeros(N, T)}, 0, "b") is None
    assert check_split_dim(None, (x, y), 0, "backbone") is None  # a later stage's input is not used
    # Tokens flattened into rows: nothing says where the samples went; said once, not stopped.
    warning = check_split_dim(torch.zeros(N * T, D), (torch.zeros(N, T), torch.zeros(N, T)), 0, "backbone")
    assert warning is not None and "split into micro-batches along dim 0, of size 40" in warning


def test_a_backbone_input_of_disagreeing_tensors_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"self.backbone's input cannot be split.*\(4, 2\), \(5, 2\).*batch_dim"):
        check_split_dim((torch.zeros(4, 2), torch.zeros(5, 2)), None, 0, "backbone")


def test_a_constant_split_with_the_batch_names_the_fix() -> None:
    # The loss-inside path splits the batch along with the output: torch.split said only "sizes must sum to 11".
    with pytest.raises(ValueError, match=r"shape \(11,\) has 11 entries along dim 0.*has 8 samples.*module buffer"):
        split_by_sizes((torch.zeros(N, D), torch.ones(V)), [4, 4])


# ------------------------------------------------------------------------------ backbones and their layers
class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.up = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x)) + x


def test_a_module_list_gets_the_adapter_recipe_and_a_plain_module_the_skip_recipe() -> None:
    module = nn.Module()
    module.backbone = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
    with pytest.raises(TypeError) as info:
        find_backbone(module, "backbone")
    message = str(info.value)
    assert "is a ModuleList" in message and "hidden, mask = x" in message and "nn.Sequential(*(" in message
    assert 'docs/guide.md, "Backbones that are not an nn.Sequential"' in message
    module.backbone = UNet()
    with pytest.raises(TypeError) as info:
        find_backbone(module, "backbone")
    message = str(info.value)
    assert "backbone.down (2 layers)" in message and "a Stash(name) layer" in message and "Pop(name)" in message
    assert "Backbones that are not an nn.Sequential" in message and "Long skip connections" in message


def test_the_guide_has_the_section_the_errors_link() -> None:
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text()
    assert "### Backbones that are not an nn.Sequential" in guide and "### Long skip connections" in guide


def test_a_one_layer_backbone_names_the_sequential_inside() -> None:
    import torchvision

    net = torchvision.models.mobilenet_v2(num_classes=5, width_mult=0.25)
    module = nn.Module()
    module.backbone = nn.Sequential(*list(net.children())[:-1])  # the children idiom: `features` is one layer
    with pytest.raises(ValueError, match=r"has 1 layer, fewer than the 2 stages.*of 19 layers.*backbone='backbone.0'"):
        check_backbone_layers(module, "backbone", module.backbone, 2)
    check_backbone_layers(module, "backbone", module.backbone, 1)


def test_the_models_own_gradient_checkpointing_is_refused_at_setup() -> None:
    import timm

    module = nn.Module()
    module.vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2
    )
    check_backbone_layers(module, "vit.blocks", module.vit.blocks, 2)
    module.vit.set_grad_checkpointing(True)
    with pytest.raises(
        ValueError, match=r"self.vit.grad_checkpointing is True.*Turn the model's own off: self.vit.set"
    ):
        check_backbone_layers(module, "vit.blocks", module.vit.blocks, 2)
    module.backbone = module.vit.blocks  # an alias: the model around it still runs the blocks itself
    with pytest.raises(ValueError, match="checkpoint_seq"):
        check_backbone_layers(module, "backbone", module.backbone, 2)
    module.vit.set_grad_checkpointing(False)
    module.vit.gradient_checkpointing = True  # HuggingFace's flag
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        check_backbone_layers(module, "backbone", module.backbone, 2)


def test_a_layer_of_another_stage_says_to_call_the_backbone_whole() -> None:
    with pytest.raises(RuntimeError, match=r"Call the pipelined module whole \(self.backbone\(x\)"):
        RemoteLayer("layer 4 (Linear) is on stage 1")(torch.zeros(1))


# ------------------------------------------------------------------------------------------ the split table
def test_the_share_column_is_what_the_header_weighs() -> None:
    backbone = nn.Sequential(*(nn.Linear(D, D) for _ in range(3)))
    plan = Plan([1, 2], "flops", [1.0, 1.0, 1.0], last_stage_scale=0.75)
    report = PartitionReport(WholeModel.read(backbone, "0", backbone), plan, [1, 2], [1.0, 1.0, 1.0])
    columns = dict(report.table())
    assert columns["Cost"] == ["1 FLOPs", "2 FLOPs"]  # as measured
    assert columns["Share (last × 0.75)"] == ["40.0%", "60.0%"]  # 1 : 2 × 0.75
    assert report.header().endswith("the costliest stage is 1.20× the mean of the weighed costs (the Share column; "
                                    "the Cost column is as measured)")  # fmt: skip
    unweighed = PartitionReport(report.whole, Plan([1, 2], "flops", [1.0, 1.0, 1.0]), [1, 2], [1.0, 1.0, 1.0])
    assert dict(unweighed.table())["Share"] == ["33.3%", "66.7%"] and unweighed.header().endswith("1.33× the mean")


# ------------------------------------------------------------------------------------ fits on two processes
class TimeMajor(pl.LightningModule):
    """Tokens from pad_sequence, time-major (T, N), labels (N,), and a time-major backbone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.backbone = nn.Sequential(*(nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0) for _ in range(2)))
        self.head = nn.Linear(D, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self.head(self.backbone(self.embed(tokens)).mean(0)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _collate(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_sequence([t for t, _ in items]), torch.tensor([y for _, y in items])


def _sequences() -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (T,), generator=g), int(torch.randint(0, 5, (), generator=g))) for _ in range(16)]


def _plain_time_major(steps: int) -> dict[str, torch.Tensor]:
    module = TimeMajor()
    opt = module.configure_optimizers()
    data = _sequences()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)  # as Lightning injects it
    for i, batch in enumerate(DataLoader(data, batch_size=N, collate_fn=_collate, sampler=sampler)):
        if i == steps:
            break
        opt.zero_grad()
        module.training_step(batch, i).backward()
        opt.step()
    return module.state_dict()


def _fit(module: pl.LightningModule, loader: DataLoader, steps: int = 2, **kwargs: Any) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    trainer = quiet_trainer(devices=2, strategy=GPipeStrategy(**{"chunks": 2, **kwargs}), max_steps=steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, loader)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    said = [str(w.message) for w in caught if str(w.message).startswith("GPipeStrategy")]
    return f"no error {said}"


class Gan(pl.LightningModule):
    """Lightning's GAN recipe (manual optimization) with the discriminator's trunk as the backbone."""

    def __init__(self, batched: bool) -> None:
        super().__init__()
        self.automatic_optimization, self.batched = False, batched
        self.gen = nn.Linear(4, D)
        self.backbone = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh())
        self.out = nn.Linear(D, 1)

    def discriminate(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0]
        n = real.shape[0]
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake = self.gen(torch.randn(n, 4))
        ones, zeros = torch.ones(n, 1), torch.zeros(n, 1)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminate(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        if self.batched:  # the fix the error gives: one call on both
            logits = self.discriminate(torch.cat([real, fake.detach()]))
            d_loss = F.binary_cross_entropy_with_logits(logits, torch.cat([ones, zeros]))
        else:
            d_loss = F.binary_cross_entropy_with_logits(self.discriminate(real), ones)
            d_loss = d_loss + F.binary_cross_entropy_with_logits(self.discriminate(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        disc = [*self.backbone.parameters(), *self.out.parameters()]
        return torch.optim.SGD(self.gen.parameters(), lr=0.1), torch.optim.SGD(disc, lr=0.1)


class Mobile(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import torchvision

        net = torchvision.models.mobilenet_v2(num_classes=5, width_mult=0.25)
        self.backbone = nn.Sequential(*list(net.children())[:-1])
        self.head = nn.Linear(net.last_channel, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x).mean((2, 3))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _with_constant(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    return x, y, torch.full((3,), 0.5)  # the same for every sample: not split, never in the pipeline


def _weighted(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
    x, y, weight = batch
    return F.mse_loss(self.head(self.backbone(self.prefix(x))), y) * weight.mean()


def fits_worker(rank: int, world_size: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    module = TimeMajor()
    out["time_major_told"] = _fit(module, DataLoader(_sequences(), batch_size=N, collate_fn=_collate), batch_dim=1)
    want = _plain_time_major(2)
    out["time_major_error"] = max((v - want[k]).abs().max().item() for k, v in module.state_dict().items())
    out["gan_batched"] = _fit(Gan(batched=True), DataLoader(dataset(), batch_size=BATCH))
    g = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g))
    out["mobilenet"] = _fit(Mobile(), DataLoader(images, batch_size=4))
    out["mobilenet_inner"] = _fit(Mobile(), DataLoader(images, batch_size=4), steps=1, backbone="backbone.0")
    weighted = lightning_module()
    weighted.training_step = _weighted.__get__(weighted)
    out["constant"] = _fit(
        weighted, DataLoader(list(zip(*dataset().tensors)), batch_size=BATCH, collate_fn=_with_constant)
    )
    # Last: it fails inside a step, after which the pipeline is not reused.
    out["time_major_unsaid"] = _fit(TimeMajor(), DataLoader(_sequences(), batch_size=N, collate_fn=_collate))
    return out


def gan_worker(rank: int, world_size: int) -> str:
    warnings.simplefilter("ignore")
    return _fit(Gan(batched=False), DataLoader(dataset(), batch_size=BATCH))


@pytest.mark.timeout(200)
def test_user_mistakes_stop_on_every_rank_and_their_fixes_run() -> None:
    for r in run_distributed(fits_worker, 2, timeout=180, lightning=True):
        # Time-major tokens and labels (N,): before, no error and weights 1e-2 off the plain run.
        assert r["time_major_unsaid"].startswith("PipelineError"), r["time_major_unsaid"]
        assert "holds 8 samples (a tensor of shape (8,))" in r["time_major_unsaid"], r["time_major_unsaid"]
        assert "GPipeStrategy(batch_dim=1)" in r["time_major_unsaid"]
        assert r["time_major_told"] == "no error []" and r["time_major_error"] <= 1e-6, r
        assert r["gan_batched"] == "no error []", r["gan_batched"]
        assert "has 1 layer, fewer than the 2 stages" in r["mobilenet"] and "backbone.0" in r["mobilenet"], r
        assert r["mobilenet_inner"] == "no error []", r["mobilenet_inner"]
        assert r["constant"] == "no error []", r["constant"]


@pytest.mark.timeout(120)
def test_a_backbone_called_again_before_backward_says_what_to_do() -> None:
    """The GAN recipe calls the discriminator on real, then on fake samples; before, the engine's words (reset())."""
    for message in run_distributed(gan_worker, 2, timeout=100, lightning=True):
        assert "self.backbone was called again, with grad, before the loss of its previous call" in message, message
        assert "torch.cat([real, fake])" in message and "reset()" not in message
