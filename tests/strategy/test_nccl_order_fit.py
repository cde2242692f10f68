"""GPipeStrategy under NCCL's point-to-point rules (``GPIPE_NCCL_SEMANTICS=1``, see ``pipe.comm.nccl_order``): fit with
the loss outside and inside the pipeline, then validate and predict, at pp × dp and K = 3 -- the same weights as the
plain run, so no transfer order of a Lightning loop would hang on GPUs."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_gpipe.pipe.comm.nccl_order import ENV
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, STEPS, TOL, Net, TinyHooked, TinyPipelined, dataset, reference


class Evaluated(TinyPipelined):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(x)))


class EvaluatedHooked(TinyHooked, Evaluated):
    pass


def worker(rank: int, world_size: int, pp: int, hooked: bool, schedule: str) -> dict[str, object]:
    from lightning_gpipe.strategy import GPipeStrategy

    os.environ[ENV] = "1"
    warnings.simplefilter("ignore")
    module = (EvaluatedHooked if hooked else Evaluated)(tied=True)
    strategy = GPipeStrategy(chunks=3, pipeline_parallel_size=pp, backbone="backbone", schedule=schedule)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS, limit_val_batches=2)
    loader = DataLoader(dataset(), batch_size=BATCH)
    trainer.fit(module, loader)
    expected = reference(world_size // pp, None, tied=True)
    errors = [
        ((p.detach().cpu() - expected[name]).abs().max() / expected[name].abs().max()).item()
        for name, p in module.named_parameters()
    ]
    val = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    predictions = trainer.predict(module, DataLoader(dataset(), batch_size=BATCH), return_predictions=True) or []
    net = Net(tied=True)
    net.load_state_dict(expected, strict=False)  # the tied head.weight is prefix.weight
    dp, replica = world_size // pp, rank // pp
    with torch.no_grad():
        plain = net(dataset().tensors[0][replica::dp])  # the predict loader's sampler: every dp-th sample, in order
    got = torch.cat([p.cpu() for p in predictions]) if predictions else None
    predicted = None if got is None else ((got - plain).abs().max() / plain.abs().max()).item()
    return {"max": max(errors), "checked": len(errors), "val": val, "predicted": predicted}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "pp", "hooked", "schedule"),
    # pp × dp with the loss outside (the output shared, buckets over replicas); K = 3 with the loss inside under 1F1B
    # (a middle stage both ways); zb-h1 at pp × dp, a weight tied across its stages. The engine's matrix
    # (tests/engine/test_nccl_order.py) runs the rest of the grid.
    [(4, 2, False, "gpipe"), (3, 3, True, "1f1b"), (4, 2, True, "zb-h1")],
)
def test_lightning_runs_under_nccl_rules(world_size: int, pp: int, hooked: bool, schedule: str) -> None:
    results = run_distributed(worker, world_size, pp, hooked, schedule, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["max"] <= TOL and r["checked"] > 4, (rank, r)
    assert len({r["val"] for r in results[:pp]}) == 1  # every stage of a pipeline logged the same value
    predicted = [r["predicted"] for r in results if r["predicted"] is not None]
    assert len(predicted) >= world_size // pp and max(predicted) <= TOL, results
