"""Precision conversions under GPipeStrategy keep every tie: a weight shared by two layers, a layer under two names."""

from __future__ import annotations

import warnings
from collections import defaultdict

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.launch import quiet_trainer, run_distributed

N, BATCH, STEPS, LR = 24, 6, 3, 0.1


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randn(N, 3, generator=g))


class Aliased(pl.LightningModule):
    """torchvision's idiom: the backbone is the whole model's layers but the last, each layer reachable under two
    names; and a weight tied across the two stages (layers 0 and 3 at balance [3, 2])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)]
        layers[3].weight = layers[0].weight
        self.model = nn.Sequential(*layers)
        self.backbone = nn.Sequential(*list(self.model.children())[:-1])
        self.head = self.model[-1]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under each of its names."""
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def tied_names(module: nn.Module) -> list[list[str]]:
    """The names that hold one tensor, for each tensor held under several."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, t in named_tensors(module).items():
        by_tensor[id(t)].append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def untied(module: nn.Module, groups: list[list[str]]) -> list[list[str]]:
    """The ``groups`` (one tensor's names) whose names present in ``module`` now hold several tensors."""
    tensors = named_tensors(module)
    found = []
    for names in groups:
        present = [tensors[n] for n in names if n in tensors]
        if len({id(t) for t in present}) > 1 or len({t.data_ptr() for t in present}) > 1:
            found.append([n for n in names if n in tensors])
    return found


def ties_worker(rank: int, world_size: int, precision: str) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Aliased()
    groups = tied_names(module)
    seen: dict[str, object] = {}

    class AfterSetup(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            present = named_tensors(pl_module)
            seen["checked"] = sum(len([n for n in g if n in present]) > 1 for g in groups)
            seen["untied"] = untied(pl_module, groups)
            seen["dtypes"] = sorted({str(p.dtype) for p in pl_module.parameters()})

    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=world_size, balance=[3, 2] if world_size == 2 else "auto")
    trainer = quiet_trainer(
        devices=world_size, strategy=strategy, precision=precision, max_steps=1, callbacks=[AfterSetup()]
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    seen["untied_after_fit"] = untied(module, groups)  # Lightning's teardown moves the module to the CPU
    return seen


# "16-true" runs float16 kernels, which a CPU may lack for some layers: the conversion is what is tested here.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2], ids=["K=1", "K=2"])
@pytest.mark.parametrize("precision", ["64-true", "bf16-true", "16-true"])
def test_every_tie_survives_the_conversion(precision: str, world_size: int) -> None:
    for rank, r in enumerate(run_distributed(ties_worker, world_size, precision, timeout=100, lightning=True)):
        assert r["dtypes"] == [str({"64": torch.float64, "bf": torch.bfloat16, "16": torch.float16}[precision[:2]])]
        # Each BatchNorm's 3 buffers and 2 parameters, each Linear's 2 (the tied weight once), all under 2 names.
        assert r["checked"] >= 5, (rank, r)
        assert r["untied"] == [], (rank, r)
        assert r["untied_after_fit"] == [], (rank, r)


def plain_fit() -> dict[str, torch.Tensor]:
    """The same steps on one device in float64, as Trainer(precision="64-true") without a strategy runs them."""
    module = Aliased().double()
    opt = module.configure_optimizers()
    for step, (x, y) in enumerate(DataLoader(data(), batch_size=BATCH)):
        if step == STEPS:
            break
        opt.zero_grad()
        module.training_step((x.double(), y.double()), step).backward()
        opt.step()
    return {name: t.detach().clone() for name, t in named_tensors(module).items()}


def fit_worker(rank: int, world_size: int) -> dict[str, list]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Aliased()
    # One micro-batch: BatchNorm then normalizes the whole batch, as on one device, so every weight can be compared.
    strategy = GPipeStrategy(chunks=1, pipeline_parallel_size=world_size, balance=[3, 2] if world_size == 2 else "auto")
    trainer = quiet_trainer(
        devices=world_size, strategy=strategy, precision="64-true", max_steps=STEPS, use_distributed_sampler=False
    )
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    return {name: [str(t.dtype), t.tolist()] for name, t in named_tensors(module).items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2], ids=["K=1", "K=2"])
def test_aliased_batch_norm_trains_as_one_layer_in_float64(world_size: int) -> None:
    want = plain_fit()
    for rank, got in enumerate(run_distributed(fit_worker, world_size, timeout=100, lightning=True)):
        stats = [n for n in got if n.endswith(("running_mean", "running_var", "num_batches_tracked"))]
        assert len(stats) >= 6, (rank, stats)  # both holders of at least one BatchNorm
        # The statistics of a BatchNorm that another stage runs are not kept up to date here (the layer's other name
        # keeps it on every stage): not a matter of the conversion.
        elsewhere = {n for n in stats if n.startswith("model.") and "backbone." + n.removeprefix("model.") not in got}
        assert len(elsewhere) == (3 if world_size == 2 else 0), (rank, elsewhere)
        for name, (dtype, value) in got.items():
            if name in elsewhere:
                continue
            expected = want[name]
            assert dtype == str(expected.dtype), (rank, name)
            where = f"rank {rank}, {name}"
            torch.testing.assert_close(
                torch.tensor(value, dtype=expected.dtype),
                expected,
                rtol=1e-12,
                atol=1e-14,
                msg=lambda m, where=where: f"{where}: {m}",
            )
