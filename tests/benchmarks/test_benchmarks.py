"""Every benchmark runs end to end as ``python -m benchmarks.<name> --smoke`` and writes its three files."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# Every module of the package: the drivers, their helpers and the shared workloads.
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["throughput", "overhead", "peers", "memory", "consistency", "partition"])
def test_benchmark_smoke_run_writes_json_markdown_and_plot(name: str, tmp_path: Path) -> None:
    # As the README says to run it: from the repo root, nothing else on the path.
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["environment"]["torch"]
    assert data["command"].startswith(f"python -m benchmarks.{name} --smoke")
    assert (tmp_path / f"{name}.md").read_text().startswith("#")
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports_from_the_package(name: str) -> None:
    """The modules no smoke run covers (engine_speed, output_modes, ...) at least import, with no path hacks."""
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__ and "\n" not in module.__doc__.strip()
    assert "sys.path" not in (ROOT / "benchmarks" / f"{name}.py").read_text()
