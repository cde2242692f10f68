"""configure_model on the meta device: each rank materializes its own stage only, with layout-independent weights."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import models
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset

SEED = 7
WIDE = 64  # backbone width: its weights dominate the parameter count


def build(tied: bool = True) -> nn.Module:
    """prefix → 8-layer backbone with BatchNorm (first and last layer tied) → head, as a plain module."""
    net = nn.Module()
    net.prefix = nn.Linear(models.D, WIDE)
    first, last = nn.Linear(WIDE, WIDE), nn.Linear(WIDE, WIDE)
    if tied:
        last.weight = first.weight
    layers = [first, nn.BatchNorm1d(WIDE), *[nn.Sequential(nn.Linear(WIDE, WIDE), nn.Tanh()) for _ in range(5)], last]
    net.backbone = nn.Sequential(*layers)
    net.head = nn.Linear(WIDE, models.D)
    return net


class Lazy(pl.LightningModule):
    """Builds everything in configure_model, as a model too big for one process would."""

    def __init__(self, custom: bool = False) -> None:
        super().__init__()
        self.custom = custom
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if hasattr(self, "backbone"):
            return
        net = build()
        if self.custom:  # a module holding a parameter without reset_parameters(): its constructor's value is kept
            net.head = nn.Sequential(net.head, _Scale())
        self.prefix, self.backbone, self.head = net.prefix, net.backbone, net.head
        self.built_on_meta = all(p.is_meta for p in self.parameters())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(self.prefix(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _fit(
    module: pl.LightningModule, pp: int, world_size: int, data_parallel: str = "ddp", precision: str = "32-true"
) -> pl.Trainer:
    from lightning_gpipe import GPipeStrategy

    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=pp, data_parallel=data_parallel),
        max_steps=1,
        precision=precision,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return trainer


def meta_worker(rank: int, world_size: int) -> dict:
    warnings.simplefilter("ignore")
    out: dict = {}
    for pp in (2, 1):
        pl.seed_everything(SEED, verbose=False)
        module = Lazy()
        _fit(module, pp, world_size)
        out[pp] = {
            "meta": module.built_on_meta,
            "state": {k: v.tolist() for k, v in module.state_dict().items()},
            "numel": sum(p.numel() for p in module.parameters()),
        }
    custom = Lazy(custom=True)
    _fit(custom, 2, world_size)
    out["custom"] = custom.head[1].gain.tolist()  # the head is on every stage
    return out


@pytest.mark.timeout(200)
def test_configure_model_materializes_only_the_local_stage_with_layout_independent_weights() -> None:
    from lightning_gpipe.strategy._materialize import materialize, record_init

    results = run_distributed(meta_worker, 2, timeout=180, lightning=True)
    # The plain model, built as configure_model is and materialized whole in this process from the same seed: what
    # every layout must reproduce.
    with torch.device("meta"), record_init() as record:
        plain = build()
    materialize(plain, dict(plain.named_modules()), torch.device("cpu"), SEED, record)
    want = {k: v.tolist() for k, v in plain.state_dict().items()}
    total = sum(p.numel() for p in plain.parameters())
    params = dict(plain.named_parameters(remove_duplicate=False))
    for rank, r in enumerate(results):
        for pp in (2, 1):
            assert r[pp]["meta"] is True, (rank, pp)  # configure_model allocated nothing
            for name, value in r[pp]["state"].items():
                if name in params:  # not buffers: the running statistics moved in the step (lr = 0 froze weights)
                    assert value == want[name], (rank, pp, name)
        assert r[1]["numel"] == total  # pp = 1: each rank holds the whole model
        assert r[2]["numel"] < 0.75 * total, (rank, r[2]["numel"], total)  # pp = 2: about half of it
        assert r["custom"] == [1.0]  # torch.ones in its __init__, replayed
    # Both stages together hold every weight once (the tied one and the replicated prefix/head on both).
    assert set(results[0][2]["state"]) | set(results[1][2]["state"]) == set(want)
    assert set(results[0][2]["state"]) & set(results[1][2]["state"]) >= {"head.weight", "prefix.weight"}
    # The tied weight, initialized on both stages (by both of its modules' initializers, in the model's order).
    assert results[1][2]["state"]["backbone.7.weight"] == results[0][2]["state"]["backbone.0.weight"]


def sharded_meta_worker(rank: int, world_size: int, precision: str) -> dict:
    """pp = 2 × dp = 2, data_parallel="fsdp": at each layer's sharding, how many of the stage's layers are whole."""
    from torch.distributed.tensor import DTensor

    from lightning_gpipe.pipe.dp import fsdp

    warnings.simplefilter("ignore")
    pl.seed_everything(SEED, verbose=False)
    module = Lazy()
    whole_at_shard: list[int] = []
    real_fully_shard = fsdp.fully_shard

    def spy(layer: nn.Module, **kwargs: object) -> object:
        stage = module.backbone
        whole_at_shard.append(
            sum(
                any(not p.is_meta and not isinstance(p, DTensor) for p in m.parameters(recurse=True))
                and not any(isinstance(p, DTensor) for p in m.parameters())
                for m in stage.children()
            )
        )
        return real_fully_shard(layer, **kwargs)

    fsdp.fully_shard = spy  # type: ignore[assignment]
    try:
        _fit(module, 2, world_size, data_parallel="fsdp", precision=precision)
    finally:
        fsdp.fully_shard = real_fully_shard
    held = module.state_dict()
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).float().tolist() for k, v in held.items()}
    sharded = sorted({k.rsplit(".", 1)[0] for k, v in held.items() if isinstance(v, DTensor)})
    dtypes = sorted({str(v.dtype) for v in held.values() if v.is_floating_point()})
    out = {"meta": module.built_on_meta, "state": state, "whole_at_shard": whole_at_shard, "sharded": sharded}
    return {**out, "dtypes": dtypes}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_configure_model_with_sharded_replicas_makes_one_layer_at_a_time(precision: str) -> None:
    """Each rank makes its stage's layers one by one, each sharded before the next is made: at most one whole layer
    beside the shards; the weights are those of every other layout (the plain materialization's), converted by the
    precision plugin after sharding (bf16-true: the shards in bf16)."""
    from lightning_gpipe.strategy._materialize import materialize, record_init

    results = run_distributed(sharded_meta_worker, 4, precision, timeout=180, lightning=True)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # bf16-true builds the module in bf16 (Lightning's init context): drawn in bf16
    try:
        with torch.device("meta"), record_init() as record:
            plain = build()
        materialize(plain, dict(plain.named_modules()), torch.device("cpu"), SEED, record)
    finally:
        torch.set_default_dtype(default)
    want = {k: v.float().tolist() for k, v in plain.state_dict().items()}
    for r in results:
        assert r["dtypes"] == [str(dtype)], r["dtypes"]
    params = dict(plain.named_parameters(remove_duplicate=False))
    for rank, r in enumerate(results):
        assert r["meta"] is True, rank
        for name, value in r["state"].items():
            if name in params:
                assert value == want[name], (rank, name)
        # Each sharding found one whole layer: the one being sharded (all of them at once would show 3, 2, 1).
        assert r["whole_at_shard"] and set(r["whole_at_shard"]) == {1}, (rank, r["whole_at_shard"])
    # The tied first and last layers stay whole (summed over the stages); the others are sharded.
    stage0, stage1 = results[0]["sharded"], results[2]["sharded"]  # layout="auto" under fsdp: rank k·D + d
    assert "backbone.0" not in stage0 and "backbone.7" not in stage1, (stage0, stage1)
    assert set(stage0) | set(stage1) == {"backbone.1", *(f"backbone.{i}.0" for i in range(2, 7))}, (stage0, stage1)
