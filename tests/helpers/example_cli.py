"""The examples' LightningCLI run as a user runs it: ``python -m examples.<name> fit --config <yaml>``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, root_on_path


def example_of(config: Path) -> str:
    """The example a config belongs to: the folder above its ``configs/``."""
    return config.parent.parent.name


def cli(
    config: Path, *args: str, cwd: Path, timeout: float, as_the_readme: bool = False
) -> subprocess.CompletedProcess:
    # As the README's command runs, OMP_NUM_THREADS unset: Lightning then gives its launching process (rank 0)
    # cpus // devices threads and the ranks it starts torch's default, so ranks differ in threads.
    env = {key: v for key, v in root_on_path().items() if key != "OMP_NUM_THREADS"}
    if not as_the_readme:
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", f"examples.{example_of(config)}", "fit", "--config", str(config), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def verify(example: str, *args: str, cwd: Path, timeout: float, steps: int = 3) -> subprocess.CompletedProcess:
    """``python -m lightning_gpipe.verify --steps N examples.<example> fit --config <its cpu.yaml> args``."""
    config = ROOT / "examples" / example / "configs" / "cpu.yaml"
    env = {**root_on_path(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_gpipe.verify", "--steps", str(steps), f"examples.{example}", "fit"]
    command += ["--config", str(config), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
