"""Every YAML in examples/*/configs parses with its example's LightningCLI; the CPU ones train with fast_dev_run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT
from tests.helpers.example_cli import cli, example_of

EXAMPLES = ("amoebanet", "nmt")
CONFIGS = sorted(c for name in EXAMPLES for c in (ROOT / "examples" / name / "configs").glob("*.yaml"))


def test_every_config_has_an_example() -> None:
    assert {example_of(c) for c in CONFIGS} == set(EXAMPLES)
    for name in EXAMPLES:
        assert (ROOT / "examples" / name / "__main__.py").is_file(), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_config_parses(config: Path, tmp_path: Path) -> None:
    run = cli(config, "--print_config", cwd=tmp_path, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = yaml.safe_load(run.stdout)
    written = yaml.safe_load(config.read_text())
    for section in ("model", "data"):
        for key, value in written.get(section, {}).items():
            assert printed[section][key] == value, (section, key)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_gpipe.GPipeStrategy"


CPU_CONFIGS = [c for c in CONFIGS if yaml.safe_load(c.read_text())["trainer"].get("accelerator") == "cpu"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", CPU_CONFIGS, ids=lambda c: c.stem)
def test_cpu_config_runs_fast_dev_run(config: Path, tmp_path: Path) -> None:
    run = cli(
        config,
        *("--trainer.fast_dev_run", "true", "--trainer.enable_progress_bar", "false"),
        cwd=tmp_path,
        timeout=280,
        as_the_readme=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "fast_dev_run" in run.stdout + run.stderr
