"""LightningCLI: the strategy from YAML (class_path + init_args), --print_config, and command-line overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import root_on_path

SCRIPT = ["-m", "tests.helpers.scripts.cli_fit"]
CONFIG = """
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  strategy:
    class_path: lightning_gpipe.GPipeStrategy
    init_args:
      chunks: 2
      pipeline_parallel_size: 2
      activation_checkpointing: always
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**root_on_path(), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=200
    )


@pytest.mark.timeout(240)
def test_yaml_config_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    printed = _cli("fit", "--config", "config.yaml", "--print_config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-2000:]
    for expected in ("lightning_gpipe.GPipeStrategy", "chunks: 2", "activation_checkpointing: always", "balance: auto"):
        assert expected in printed.stdout, printed.stdout
    report = tmp_path / "report"
    run = _cli(
        "fit", "--config", "config.yaml", "--trainer.strategy.chunks", "3", "--model.report", str(report), cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    facts = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(2)]
    assert sorted(f["stage"] for f in facts) == [0, 1]
    assert all(f["chunks"] == 3 and f["K"] == 2 for f in facts), facts


@pytest.mark.timeout(240)
def test_strategy_by_its_registered_name(tmp_path: Path) -> None:
    """`strategy: gpipe` in YAML works once the entry point has imported lightning_gpipe (the package registers it)."""
    config = CONFIG.split("  strategy:")[0] + "  strategy: gpipe\n"
    (tmp_path / "config.yaml").write_text(config)
    report = tmp_path / "report"
    run = _cli("fit", "--config", "config.yaml", "--model.report", str(report), cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    facts = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(2)]
    assert sorted(f["stage"] for f in facts) == [0, 1]
    assert all(f["chunks"] == 8 and f["K"] == 2 for f in facts), facts  # GPipeStrategy's defaults


@pytest.mark.timeout(60)
def test_import_registers_the_strategy_and_the_engine_imports_without_lightning() -> None:
    code = """
import sys
from lightning.pytorch.strategies import StrategyRegistry
assert "gpipe" not in StrategyRegistry
import lightning_gpipe
from lightning.pytorch import Trainer
from lightning_gpipe import GPipeStrategy
assert isinstance(Trainer(strategy="gpipe", accelerator="cpu", devices=1, logger=False).strategy, GPipeStrategy)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    # Lightning made unimportable: the engine still imports, and asking for the strategy says what is missing.
    code = """
import sys
sys.modules["lightning"] = None
import lightning_gpipe
from lightning_gpipe.pipe import GPipeStage
try:
    lightning_gpipe.GPipeStrategy
except ImportError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPipeStrategy needs Lightning" in done.stdout, done.stdout


def test_every_strategy_argument_is_explained_in_the_cli_help() -> None:
    """``--trainer.strategy.help lightning_gpipe.GPipeStrategy`` shows the docstring's ``Args:`` for each one."""
    import inspect
    import re

    from jsonargparse import ArgumentParser

    from lightning_gpipe import GPipeStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(GPipeStrategy, "strategy")
    text = parser.format_help()
    text = text[text.index("options:") :]  # past the usage line
    names = [n for n in inspect.signature(GPipeStrategy.__init__).parameters if n != "self"]
    starts = {n: text.index(f"\n  --strategy.{n} ") for n in names}
    ends = [*sorted(starts.values()), len(text)]
    for name, at in starts.items():
        block = " ".join(text[at : ends[ends.index(at) + 1]].split())
        described = block.split("(type:")[0]
        # The option, its metavar, then the docstring's description (words) before "(type: ...)".
        assert len(re.findall(r"[A-Za-z]{2,}", described.split(" ", 2)[-1])) >= 4, (name, block)
