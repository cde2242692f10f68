"""configure_model under GPipeStrategy: a model starts from its own initialization, or a warning names what does not.

Libraries initialize in their constructors (timm's ResNet: fan-out kaiming convolutions and zeroed last BatchNorm of
each residual block; torchvision's loop in ``ResNet.__init__``; timm's ViT: truncated-normal position embedding),
which on the meta device does nothing. Compared with the same model built normally (on the CPU, no strategy):
tensors whose initialization has no randomness are equal; random ones cannot be (GPipe seeds each call by its place,
so that every layout draws the same), so they must come from the same distribution, and be the same at K = 1 and 2.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.init import orthogonal_  # imported before recording: torch.nn.init's wrapper never sees this name
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.strategy._materialize import materialize, record_init
from tests.helpers.init_summary import MARK, assert_same_distribution, summary
from tests.helpers.launch import quiet_trainer, run_distributed

SEED, SIDE, CLASSES = 11, 32, 10


# ------------------------------------------------------------------------------------------------------- models
def timm_resnet() -> tuple[nn.Sequential, nn.Module]:
    import timm

    net = timm.create_model("resnet18", num_classes=CLASSES)
    trunk = [net.conv1, net.bn1, net.act1, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4]
    return nn.Sequential(*trunk), nn.Sequential(net.global_pool, net.fc)


def torchvision_resnet() -> tuple[nn.Sequential, nn.Module]:
    from torchvision.models import resnet18

    net = resnet18(num_classes=CLASSES, zero_init_residual=True)
    trunk = [net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4]
    return nn.Sequential(*trunk), nn.Sequential(net.avgpool, nn.Flatten(), net.fc)


class ViTEmbed(nn.Module):
    """A ViT's patch embedding, class token and position embedding: parameters held directly, no reset_parameters."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        return torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed


class ViTHead(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(x)[:, 0])


def timm_vit() -> tuple[nn.Sequential, nn.Module]:
    import timm

    net = timm.create_model("vit_tiny_patch16_224", img_size=SIDE, patch_size=8, depth=2, num_classes=CLASSES)
    return nn.Sequential(ViTEmbed(net), *net.blocks), ViTHead(net.norm, net.head)


BUILDERS = {"timm_resnet18": timm_resnet, "timm_vit": timm_vit, "torchvision_resnet18": torchvision_resnet}
# The table: (tensor, what is reported: its std or its largest |value|).
TABLE = {
    "timm_resnet18": [
        ("backbone.0.weight", "std"),
        ("backbone.4.0.conv1.weight", "std"),
        ("backbone.4.0.bn2.weight", "max"),
    ],
    "torchvision_resnet18": [
        ("backbone.0.weight", "std"),
        ("backbone.4.0.conv1.weight", "std"),
        ("backbone.4.0.bn2.weight", "max"),
    ],
    "timm_vit": [
        ("backbone.0.pos_embed", "std"),
        ("backbone.0.cls_token", "std"),
        ("backbone.1.attn.qkv.weight", "std"),
        ("backbone.0.patch_embed.proj.weight", "std"),
    ],
}


class Split(pl.LightningModule):
    """A library model built in configure_model, split into a pipelined trunk and a head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.initial: dict[str, dict[str, Any]] | None = None

    def configure_model(self) -> None:
        if not hasattr(self, "backbone"):
            self.backbone, self.head = BUILDERS[self.kind]()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def on_train_start(self) -> None:
        self.initial = summary(self)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def built_normally(kind: str, seed: int) -> dict[str, dict[str, Any]]:
    pl.seed_everything(seed, verbose=False)
    module = Split(kind)
    module.configure_model()
    return summary(module)


def built_as_gpipe_does(kind: str) -> dict[str, dict[str, Any]]:
    """The whole model built as under GPipeStrategy, in this process, from the seed the strategy will use."""
    module = Split(kind)
    with torch.device("meta"), record_init() as record:
        module.configure_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no tensor of these models may fall back
        materialize(module, dict(module.named_modules()), torch.device("cpu"), SEED, record)
    return summary(module)


# -------------------------------------------------------------------------------------- through GPipeStrategy
def init_worker(rank: int, world_size: int) -> dict:
    from lightning_gpipe import GPipeStrategy

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (8,), generator=g))
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in BUILDERS:
            for pp in (2, 1):
                pl.seed_everything(SEED, verbose=False)
                module = Split(kind)
                trainer = quiet_trainer(
                    devices=world_size, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=pp), max_steps=1
                )
                trainer.fit(module, DataLoader(data, batch_size=4))
                out[kind, pp] = module.initial
    out["warnings"] = [str(w.message) for w in caught if MARK in str(w.message)]
    return out


@pytest.mark.timeout(240)
def test_library_models_built_in_configure_model_start_from_their_own_initialization() -> None:
    results = run_distributed(init_worker, 2, timeout=220, lightning=True)
    assert [r["warnings"] for r in results] == [[], []]
    for kind in BUILDERS:
        normal, other_seed, replayed = (
            built_normally(kind, SEED),
            built_normally(kind, SEED + 1),
            built_as_gpipe_does(kind),
        )
        assert set(replayed) == set(normal)
        for pp in (2, 1):
            got = {k: v for r in results for k, v in r[kind, pp].items()}
            assert set(got) == set(normal), (kind, pp)
            for k, v in got.items():
                # Layout-independent: the same bytes at K = 1 and 2 as the whole model materialized here.
                assert v["sha"] == replayed[k]["sha"], (kind, pp, k)
                if normal[k]["sha"] == other_seed[k]["sha"]:  # no randomness: equal to the normal build
                    assert v["sha"] == normal[k]["sha"], (kind, pp, k)
                else:
                    assert_same_distribution(v, normal[k], f"{kind} {k} pp={pp}")
            if pp == 2:  # each stage holds part of the trunk only
                assert all(len(r[kind, 2]) < len(normal) for r in results), kind
        for k, stat in TABLE[kind]:
            row = [normal[k][stat]] + [results[0][kind, pp].get(k, results[1][kind, pp].get(k))[stat] for pp in (1, 2)]
            print(f"{kind:22s} {k:36s} {stat}: normal {row[0]:.6g}  K=1 {row[1]:.6g}  K=2 {row[2]:.6g}")
        if "resnet" in kind:  # the issue's numbers: fan-out kaiming, and the residual blocks' last BN zeroed
            assert results[0][kind, 1]["backbone.0.weight"]["std"] == pytest.approx(math.sqrt(2 / (64 * 49)), rel=0.05)
            assert results[0][kind, 1]["backbone.4.0.conv1.weight"]["std"] == pytest.approx(
                math.sqrt(2 / 576), rel=0.05
            )
            assert all(results[0][kind, pp]["backbone.4.0.bn2.weight"]["max"] == 0.0 for pp in (1, 2))


# ------------------------------------------------------------------------------------------------ in-process
class Odd(nn.Module):
    """Initializations reset_parameters() does not give: out-of-place, partial, orthogonal, copied from the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(64, 32) * 0.02)  # a product of a draw: the draw is replayed too
        self.lin = nn.Linear(32, 32)
        self.lin.weight.data[0].zero_()  # a view of a parameter, written after its reset
        nn.init.orthogonal_(self.lin.weight[1:])  # torch.nn.init skips meta tensors here without a trace
        table = torch.arange(16, dtype=torch.float64, device="cpu").reshape(4, 4).sin()  # computed on the CPU
        self.register_buffer("table", torch.empty(4, 4))
        self.table.copy_(table)
        self.steps = nn.Parameter(torch.arange(6.0).double())  # made, then converted to another dtype


@pytest.mark.timeout(60)
def test_recorded_calls_are_replayed_exactly() -> None:
    torch.manual_seed(SEED)
    normal = Odd()
    with torch.device("meta"), record_init() as record:
        lazy = Odd()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        materialize(lazy, dict(lazy.named_modules()), torch.device("cpu"), SEED, record)
    assert torch.equal(lazy.table, normal.table) and torch.equal(lazy.steps, normal.steps)
    assert lazy.steps.dtype == torch.float64
    assert torch.equal(lazy.lin.weight[0], torch.zeros(32))
    q = lazy.lin.weight[1:]
    assert torch.allclose(q @ q.T, torch.eye(31), atol=1e-5)  # orthogonal rows, as nn.init.orthogonal_ makes
    assert lazy.scale.std().item() == pytest.approx(0.02, rel=0.1)
    bound = 1 / math.sqrt(32)  # nn.Linear's bias: its own reset_parameters, U(-1/sqrt(in), 1/sqrt(in))
    assert lazy.lin.bias.abs().max() <= bound and lazy.lin.bias.std() > bound / 3


@pytest.mark.timeout(60)
def test_a_tensor_created_empty_is_replayed_in_its_new_memory() -> None:
    """materialize() gives replay the new tensor: one created empty is initialized in it, to the same values as
    replayed apart; the others are replayed apart (and copied in)."""
    with torch.device("meta"), record_init() as record:
        lazy = Odd()
    cpu = torch.device("cpu")
    for t, created_empty in [(lazy.lin.weight, True), (lazy.table, True), (lazy.scale, False), (lazy.steps, False)]:
        apart, _ = record.replay(t, cpu, SEED)
        into = torch.full_like(t, float("nan"), device=cpu)
        value, _ = record.replay(t, cpu, SEED, into=into)
        assert torch.equal(value, apart)
        assert (value.data_ptr() == into.data_ptr()) == created_empty
        assert torch.equal(into, apart) == created_empty


@pytest.mark.timeout(60)
def test_materialize_allocates_a_tensor_created_empty_once() -> None:
    """An LLM's embedding can be a third of a stage: no second copy of it on the way (the peak would be 1.3×)."""
    cpu = torch.device("cpu")
    with torch.device("meta"), record_init() as record:
        wide = nn.Embedding(4096, 64)
        nn.init.normal_(wide.weight, std=0.02)  # as transformers initializes it: replayed, not reset
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        materialize(wide, dict(wide.named_modules()), cpu, SEED, record)
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in profiler.events())
    assert wide.weight.nbytes <= allocated < 1.1 * wide.weight.nbytes  # the weight itself, initialized in place


@pytest.mark.timeout(60)
def test_the_project_models_keep_their_reset_parameters_initialization() -> None:
    """This package's models initialize in reset_parameters() by design: bit-identical to before the recording."""
    from lightning_gpipe.models.amoebanet import amoebanet_d
    from lightning_gpipe.models.transformer import transformer_nmt

    for make in (
        lambda: transformer_nmt(2, 16, 4, d_model=16, vocab_size=50, tie_embeddings=True),
        lambda: amoebanet_d(4, 3, 8, 0.0),
    ):
        with torch.device("meta"):
            before = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # built outside configure_model: warned, reset_parameters() for all
            materialize(before, dict(before.named_modules()), torch.device("cpu"), SEED)
        with torch.device("meta"), record_init() as record:
            now = make()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            materialize(now, dict(now.named_modules()), torch.device("cpu"), SEED, record)
        a, b = before.state_dict(), now.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(3, 3))
        orthogonal_(self.gain)  # invisible on meta: the recorder sees a tensor made empty and never written


@pytest.mark.timeout(60)
def test_what_cannot_be_reproduced_is_named_before_training() -> None:
    # Built on the meta device outside configure_model(): nothing recorded, reset_parameters() and a warning.
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"0\.weight, 0\.bias: built on the meta device outside configure_model"):
        materialize(plain, dict(plain.named_modules()), torch.device("cpu"), SEED)
    with torch.device("meta"):
        no_reset = nn.Sequential(Gain())
    with pytest.raises(TypeError, match=r"0\.gain \(Gain\).*reset_parameters\(\).*load the intended weights"):
        materialize(no_reset, dict(no_reset.named_modules()), torch.device("cpu"), SEED)

    # Recorded, but not reproducible: an explicit generator, a CPU source changed afterwards, an invisible init.
    g = torch.Generator().manual_seed(0)
    source = torch.ones(4, 4)
    with torch.device("meta"), record_init() as record:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Gain())
        nn.init.normal_(model[0].weight, generator=g)
        model[1].weight.data.copy_(source)
    source.add_(1)
    with pytest.warns(UserWarning) as caught:
        materialize(model, dict(model.named_modules()), torch.device("cpu"), SEED, record)
    message = str(caught[0].message)
    assert "0.weight: normal_ drew from an explicit torch.Generator" in message
    assert "1.weight: a tensor that TensorBase.copy_ read was modified after configure_model()" in message
    assert "2.gain: created by" in message and "never written" in message and "left so" in message
    assert "load the intended weights after setup (in on_fit_start" in message
    bound = 1 / math.sqrt(4)  # both Linears fell back to their reset_parameters(): kaiming-uniform within ±1/2
    assert model[0].weight.abs().max() <= bound and model[1].weight.abs().max() <= bound
