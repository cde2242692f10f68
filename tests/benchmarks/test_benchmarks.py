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
@pytest.mark.parametrize(
    "name",
    [
        "throughput",
        "overhead",
        "peers",
        "memory",
        "consistency",
        "partition",
        "dp_overlap",
        "input_pipeline",
        "dp_hierarchy",
    ],
)
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


def run_smoke(name: str, out: Path, *extra: str) -> dict:
    """``python -m benchmarks.<name> --smoke --out-dir out *extra`` from the repo root; its JSON."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out-dir", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stem = "memory_schedules" if "--schedules" in extra else name
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / f"{stem}.json").read_text())


@pytest.mark.timeout(60)
def test_overhead_compares_the_three_loss_paths_with_their_efficiency(tmp_path: Path) -> None:
    data = run_smoke("overhead", tmp_path, "--models", "transformer")
    rows = data["rows"]
    assert [(r["model"], r["K"], r["path"]) for r in rows] == [
        ("transformer", 2, p) for p in ("whole-batch", "gpipe", "1f1b")
    ]
    for r in rows:
        assert 0.0 < r["efficiency"] <= 1.5, r
        assert r["span_ms"] > 0 and r["vs_whole"] > 0
        assert (tmp_path / f"overhead_transformer_k2_{r['path']}.png").exists()
    # The per-micro-batch paths record each micro-batch's loss inside the pipeline; whole-batch, one loss between.
    assert all(r["loss"] > 0 for r in rows)
    md = (tmp_path / "overhead.md").read_text()
    assert "efficiency (ideal GPipe step / step)" in md and "| 1f1b |" in md and "| whole-batch |" in md


@pytest.mark.timeout(60)
def test_memory_schedules_1f1b_holds_fewer_micro_batches_than_gpipe_on_stage_0(tmp_path: Path) -> None:
    data = run_smoke("memory", tmp_path, "--schedules", "--models", "transformer")
    rows = {(r["K"], r["stage"]): r for r in data["memory"]}
    assert set(rows) == {(2, 0), (2, 1)}
    first, last = rows[2, 0], rows[2, 1]
    assert (first["gpipe_inflight"], first["1f1b_inflight"], last["gpipe_inflight"], last["1f1b_inflight"]) == (
        8,
        2,
        1,
        1,
    )
    assert 0.0 < first["1f1b_mb"] < first["gpipe_mb"]  # M = 8 micro-batches held vs 2
    assert last["1f1b_mb"] > 0 and last["gpipe_mb"] > 0
    (timing,) = data["time"]
    assert timing["gpipe_ms"] > 0 and timing["1f1b_ms"] > 0 and timing["time_ratio"] > 0


@pytest.mark.timeout(60)
def test_peers_sets_ours_gpipe_and_1f1b_beside_torchs_schedules(tmp_path: Path) -> None:
    data = run_smoke("peers", tmp_path)
    systems = {r["system"] for r in data["fixed"]}
    assert {"ours gpipe", "ours 1f1b", "torch GPipe", "torch 1F1B", "plain"} <= systems
    (ratios,) = data["ratios"]
    assert all(ratios[k] > 0 for k in ("gpipe_torch", "1f1b_torch", "gpipe_el_torch", "1f1b_el_torch"))
    # Same weights and batch: the first step's loss agrees across every system, ours' 1F1B and torch's included.
    losses = [r["first_loss"] for r in data["fixed"]]
    assert max(losses) - min(losses) < 1e-5
    # The variable-length run still works, and ours' 1F1B runs every length with the plain model's loss.
    var = {r["system"]: r for r in data["variable"]}
    assert var["ours except_last"]["match"] == "yes" and var["ours 1f1b (except_last)"]["match"] == "yes"
