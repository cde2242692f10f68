"""The schedules beyond GPipe's on the model families users bring: a zb-h1 or interleaved fit is the plain run.

zb-h1 splits the backwards of the linear, convolution and embedding ops it meets inside the modules, as the libraries
wrote them (timm's ConvNeXt runs its MLP's Linear on a channels-last permute, MLP-Mixer its token mixing on a
transpose, MobileNetV3 depthwise and squeeze-excite convolutions); interleaving (1F1B and zero bubble) cuts each
backbone into 2K chunks, and so does zb-v, placed in a V.
Each family runs with its head and loss inside the pipeline (``families.INSIDE``), K = 2, float64: after a short fit
every weight and buffer equals the plain run's.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.families import FAMILIES, INSIDE, family_error, split_forward
from tests.helpers.habits_modules import BATCH, STEPS, make_module, plain_run, scenario_data
from tests.helpers.launch import quiet_trainer, run_distributed

TOL = 1e-10  # float64
# schedule: virtual stages per rank (v); zb-v's two chunks sit in a V (the head and loss on rank 0)
SCHEDULES = {"zb-h1": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zb-v": 2}
K = 2


def _runs() -> list[tuple[str, str]]:
    """(family, schedule) pairs that can run: interleaving needs v·K layers in the backbone."""
    sizes = {name: len(spec["build"]()["model"].get_submodule(spec["path"][6:])) for name, spec in FAMILIES.items()}
    return [(name, s) for name in FAMILIES for s, v in SCHEDULES.items() if sizes[name] >= v * K]


def fit_all(rank: int, world_size: int, runs: list[tuple[str, str]]) -> dict[str, Any]:
    from lightning_gpipe.pipe.run.weight_grad import WeightGrads
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    deferred = [0]  # weight gradients that W ran: the split happened, not only the schedule's order
    run = WeightGrads.run

    def counted(self: WeightGrads, m: int) -> None:
        deferred[0] += len(self._pending.get(m, []))
        run(self, m)

    WeightGrads.run = counted  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for name, schedule in runs:
        deferred[0] = 0
        spec = INSIDE[name]
        module = make_module(spec)
        strategy = GPipeStrategy(
            chunks=spec.get("chunks", 4),
            backbone=spec["path"],
            schedule=schedule,
            virtual_stages=SCHEDULES.get(schedule, 1),
            save_distributed_checkpoint=False,
        )
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
        trainer.fit(module, DataLoader(scenario_data(spec["data"]), batch_size=BATCH))
        want = plain_run(spec, 1).state_dict()
        out[f"{name} {schedule}"] = {k: family_error(v, want[k]) for k, v in module.state_dict().items()}
        out[f"{name} {schedule} deferred"] = deferred[0]
    return out


def test_the_split_forwards_are_the_models_forwards() -> None:
    for name, spec in FAMILIES.items():
        model = spec["build"]()["model"].eval()
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        features, head = split_forward(name)
        assert torch.equal(head(model, model.get_submodule(spec["path"][6:])(features(model, x))), model(x)), name


@pytest.mark.timeout(600)
def test_families_fit_under_zb_h1_and_interleaving_as_the_plain_run() -> None:
    runs = _runs()
    assert ("timm_convnext", "interleaved-1f1b") in runs and ("timm_swin", "interleaved-1f1b") not in runs
    results = run_distributed(fit_all, K, runs, timeout=560, lightning=True)
    for name, schedule in runs:
        moved = plain_run(INSIDE[name], 1).state_dict()
        initial = make_module(INSIDE[name]).state_dict()
        assert max(family_error(moved[k], v) for k, v in initial.items()) > 1e-3, name  # the run changed the weights
        if schedule == "zb-h1" and INSIDE[name].get("chunks", 4) > 1:  # M = 1: W follows I at once, fused
            assert results[0][f"{name} zb-h1 deferred"] == 0 < results[1][f"{name} zb-h1 deferred"], name
        for rank, r in enumerate(results):
            errors: dict[str, Any] = r[f"{name} {schedule}"]
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, (name, schedule, rank, worst, errors[worst])
