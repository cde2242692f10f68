"""Model families users bring, plugged in as their libraries build them: a pipelined fit is the plain run.

timm's ConvNeXt, Swin, MLP-Mixer and MobileNetV3 (BatchNormAct2d) and torchvision's MobileNetV3, each with its own
``nn.Sequential`` of stages or blocks as the backbone (``GPipeStrategy(backbone="model.stages")``): after a short
fit at K = 2 in float64 every weight and buffer equals the plain run's, and so does the checkpoint file.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.families import FAMILIES, family_error
from tests.helpers.habits_modules import BATCH, STEPS, make_module, plain_run, scenario_data
from tests.helpers.launch import quiet_trainer, run_distributed

TOL = 1e-10  # float64


def fit_all(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for name, spec in FAMILIES.items():
        module = make_module(spec)
        strategy = GPipeStrategy(chunks=spec.get("chunks", 4), backbone=spec["path"], save_distributed_checkpoint=False)
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
        trainer.fit(module, DataLoader(scenario_data(spec["data"]), batch_size=BATCH))
        ckpt = f"{workdir}/{name}.ckpt"
        trainer.save_checkpoint(ckpt)
        want = plain_run(spec, 1).state_dict()
        got = module.state_dict()
        errors = {k: family_error(v, want[k]) for k, v in got.items()}
        held = sum(p.numel() for p in strategy.stage.parameters())
        whole = sum(p.numel() for p in spec["build"]()["model"].get_submodule(spec["path"][6:]).parameters())
        result: dict[str, Any] = {"errors": errors, "held": held, "whole": whole}
        if trainer.is_global_zero:
            saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
            result["file_keys"] = sorted(saved) == sorted(want)
            result["file_error"] = max(family_error(v, want[k]) for k, v in saved.items())
        out[name] = result
    return out


@pytest.mark.timeout(600)
def test_model_families_train_as_the_plain_run(tmp_path: Any) -> None:
    results = run_distributed(fit_all, 2, str(tmp_path), timeout=560, lightning=True)
    for name in FAMILIES:
        for rank, r in enumerate(results):
            got = r[name]
            worst = max(got["errors"], key=got["errors"].get)
            assert got["errors"][worst] <= TOL, (name, rank, worst, got["errors"][worst])
            assert 0 < got["held"] < got["whole"], (name, rank, got["held"], got["whole"])  # one stage each
        assert results[0][name]["file_keys"] and results[0][name]["file_error"] <= TOL, (name, results[0][name])
        moved = plain_run(FAMILIES[name], 1).state_dict()
        initial = make_module(FAMILIES[name]).state_dict()
        assert max(family_error(moved[k], v) for k, v in initial.items()) > 1e-3, name  # the run changed the weights
