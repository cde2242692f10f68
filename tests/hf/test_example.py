"""examples/llm: its configs parse with its LightningCLI; the CPU ones train with fast_dev_run as its README says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.helpers.example_cli import cli

pytest.importorskip("transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'")

CONFIGS = sorted((ROOT / "examples" / "llm" / "configs").glob("*.yaml"))


def test_the_example_has_configs_for_cpu_and_gpus() -> None:
    accelerators = {yaml.safe_load(c.read_text())["trainer"].get("accelerator") for c in CONFIGS}
    assert {"cpu", "gpu"} <= accelerators, accelerators


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_parses(config: Path, tmp_path: Path) -> None:
    run = cli(config, "--print_config", cwd=tmp_path, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    printed, written = yaml.safe_load(run.stdout), yaml.safe_load(config.read_text())
    for section in ("model", "data"):
        for key, value in written.get(section, {}).items():
            assert printed[section][key] == value, (section, key)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_gpipe.GPipeStrategy"


CPU_CONFIGS = [c for c in CONFIGS if yaml.safe_load(c.read_text())["trainer"].get("accelerator") == "cpu"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda c: c.stem)
def test_cpu_config_runs_fast_dev_run(config: Path, tmp_path: Path) -> None:
    args = ("--trainer.fast_dev_run", "true", "--trainer.enable_progress_bar", "false")
    run = cli(config, *args, cwd=tmp_path, timeout=280, as_the_readme=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "fast_dev_run" in run.stdout + run.stderr


@pytest.mark.timeout(200)
def test_verify_calls_the_example_the_same_run(tmp_path: Path) -> None:
    """``python -m lightning_gpipe.verify`` on the example's CPU configuration (its head tied to the embedding across
    the stages, AdamW): float64, every parameter within 1e-9 of the plain run's after 3 steps."""
    from tests.helpers.example_cli import verify

    run = verify("llm", cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "verdict: same run" in run.stdout, run.stdout[-3000:]
