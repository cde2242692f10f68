"""Every benchmark runs end to end as ``python -m benchmarks.<name> --smoke`` and writes its results files (the studies:
``python -m benchmarks.studies.<name>``)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

BENCHMARKS = ROOT / "benchmarks"
# The entry points (``python -m benchmarks.<name>``) sit in benchmarks/, the one-off studies in benchmarks/studies/
# (``python -m benchmarks.studies.<name>``), everything they share in benchmarks/_lib/.
ENTRY_POINTS = sorted(
    [p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__"]
    + [f"studies.{p.stem}" for p in (BENCHMARKS / "studies").glob("*.py") if p.stem != "__init__"]
)
SUPPORT = sorted(f"_lib.{p.stem}" for p in (BENCHMARKS / "_lib").glob("*.py") if p.stem != "__init__")
# Entry points the suite does not smoke-run, and why (each but report has --smoke, checked below).
NOT_RUN = {
    "report": "it redraws stored figures and measures nothing (tests/benchmarks/test_figures.py runs it)",
    # Each --smoke takes 45-70 s on the shared 2-core VM (a worker imports Lightning; 2 or 3 launches): past the
    # suite's budget for another benchmark (about 15 s; dp_cost_model, 20 s, is the cheapest run, as partition).
    "studies.engine_speed": "python -m benchmarks.studies.engine_speed --smoke --out-dir DIR: 61 s",
    "studies.output_modes": "python -m benchmarks.studies.output_modes --smoke --out-dir DIR: 45 s",
    "studies.remat_forward_ab": "python -m benchmarks.studies.remat_forward_ab --smoke --out-dir DIR: 67 s",
    "studies.receive_ahead": "python -m benchmarks.studies.receive_ahead --smoke --out-dir DIR: 21 s",
    # Three launches (4, 8 and 1 processes, each importing Lightning) and four Trainer fits: 47 s on the idle VM,
    # 59-109 s beside other test runs.
    "fsdp": "python -m benchmarks.fsdp --smoke --out-dir DIR: 47 s",
    # Inductor compiles the tiny Transformer's seven layers on both ranks: 34 s with a warm cache, more without.
    "compiled": "python -m benchmarks.compiled --smoke --out-dir DIR: 34 s",
}
# Entry points smoke-run once, by a test of their own below that also checks what they measured.
SMOKE_RUN_BY_OWN_TEST = {
    "peers_hf": "test_peers_hf_sets_a_huggingface_llama_beside_torchs_schedules",
    "studies.interleaved_split": "test_interleaved_split_compares_the_two_cuts_side_by_side",
}
SMOKE_RUNS = [
    "throughput",
    "overhead",
    "peers",
    "memory",
    "consistency",
    "partition",
    "dp_overlap",
    "input_pipeline",
    "dp_hierarchy",
    "dp_cost_model",
    "schedules",
    "peers_schedules",
    "skips",
    "studies.zb_split",
    "studies.zb_v_memory",
    "auto_plan",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SMOKE_RUNS)
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
    stem = name.rpartition(".")[2]  # a study writes its results under its own name, as a benchmark does
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["environment"]["torch"]
    assert data["command"].startswith(f"python -m benchmarks.{name} --smoke")
    assert (tmp_path / f"{stem}.md").read_text().startswith("#")
    if hasattr(importlib.import_module(f"benchmarks.{name}"), "plot"):  # the benchmarks that draw a figure
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_entry_point_has_a_smoke_run() -> None:
    assert sorted(SMOKE_RUNS + list(NOT_RUN) + list(SMOKE_RUN_BY_OWN_TEST)) == ENTRY_POINTS
    assert all(test in globals() for test in SMOKE_RUN_BY_OWN_TEST.values())
    for name in set(ENTRY_POINTS) - {"report"}:
        assert '"--smoke"' in (BENCHMARKS / f"{name.replace('.', '/')}.py").read_text(), name


@pytest.mark.parametrize("name", ENTRY_POINTS + SUPPORT)
def test_benchmark_module_imports_from_the_package(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__ and "\n" not in module.__doc__.strip()
    assert "sys.path" not in (BENCHMARKS / f"{name.replace('.', '/')}.py").read_text()


def imports(path: Path, root: Path) -> tuple[set[str], bool]:
    """The benchmarks modules a file under ``root`` imports, at any depth (inside functions too), and whether it runs
    as a script."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("benchmarks")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("benchmarks"):
            # ``from benchmarks._lib import report`` imports the module benchmarks._lib.report.
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (root / f"{sub.replace('.', '/')}.py").exists()
                found.add(sub if is_module else str(node.module))
    main = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
    return found, main


def import_graph(package: Path) -> dict[str, tuple[set[str], bool]]:
    root = package.parent
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): imports(p, root)
        for p in sorted(package.rglob("*.py"))
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, found by a depth-first search (each once, from its smallest module)."""
    found: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # a circle is reported from its smallest module only
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_no_import_circle_and_support_modules_apart_from_entry_points() -> None:
    graph = import_graph(BENCHMARKS)
    assert cycles({m: deps for m, (deps, _) in graph.items()}) == []
    for module, (deps, main) in graph.items():
        support = module.startswith("benchmarks._lib") or module in ("benchmarks", "benchmarks.studies")
        # Entry points run as scripts and import only the support modules; those never run and never import back.
        assert main != support, (module, "runs as a script" if main else "does not run as a script")
        assert all(d.startswith("benchmarks._lib") for d in deps), (module, deps)


def run_smoke(name: str, out: Path, *extra: str) -> dict:
    """``python -m benchmarks.<name> --smoke --out-dir out *extra`` from the repo root; its JSON."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out-dir", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stem = "memory_schedules" if "--schedules" in extra else name
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / f"{stem}.json").read_text())


@pytest.mark.timeout(160)
def test_overhead_compares_the_seven_loss_paths_with_their_efficiency(tmp_path: Path) -> None:
    data = run_smoke("overhead", tmp_path, "--models", "transformer")
    rows = data["rows"]
    assert [(r["model"], r["K"], r["path"]) for r in rows] == [
        ("transformer", 2, p)
        for p in ("whole-batch", "gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zb-v")
    ]
    for r in rows:
        assert 0.0 < r["efficiency"] <= 1.5, r
        assert r["span_ms"] > 0 and r["vs_whole"] > 0
        assert (tmp_path / f"overhead_transformer_k2_{r['path']}.png").exists()
    # The per-micro-batch paths record each micro-batch's loss inside the pipeline; whole-batch, one loss between.
    assert all(r["loss"] > 0 for r in rows)
    md = (tmp_path / "overhead.md").read_text()
    assert "efficiency (ideal GPipe step / step)" in md and "| 1f1b |" in md and "| whole-batch |" in md
    assert "| zb-h1 |" in md and rows[3]["backward"] > 0 and rows[5]["backward"] > 0  # I and W count as backward
    assert "| interleaved-1f1b |" in md and len(data["raw"]["2"]["transformer"]["interleaved-1f1b"]["steps"]) >= 3
    assert "| interleaved-zb |" in md and "| zb-v |" in md


@pytest.mark.timeout(160)
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
    assert (first["zb-h1_inflight"], last["zb-h1_inflight"]) == (2, 2)
    assert 0.0 < first["zb-h1_mb"] < first["gpipe_mb"] and last["zb-h1_mb"] > 0
    assert first["zb-v_mb"] > 0 and last["zb-v_mb"] > 0 and first["zb-v_inflight"] > 0  # two chunks per rank in a V
    (timing,) = data["time"]
    assert timing["gpipe_ms"] > 0 and timing["1f1b_ms"] > 0 and timing["time_ratio"] > 0
    assert timing["zb-h1_ms"] > 0 and timing["zb_time_ratio"] > 0
    # Interleaved (v = 2): the simulator's peak of chunk micro-batches over v, K = 2, M = 8: 5 and 3 chunks.
    assert (first["interleaved-1f1b_inflight"], last["interleaved-1f1b_inflight"]) == (2.5, 1.5)
    assert first["interleaved-1f1b_mb"] > 0 and timing["il_time_ratio"] > 0


@pytest.mark.timeout(160)
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


@pytest.mark.timeout(160)
def test_peers_schedules_without_rematerialization_runs_the_same_work_on_both_sides(tmp_path: Path) -> None:
    data = run_smoke("peers_schedules", tmp_path, "--rematerialization", "never")
    systems = {r["system"] for r in data["fixed"]}
    assert systems == {"ours 1f1b", "ours zb-h1", "ours interleaved-1f1b", "ours interleaved-zb", "ours zb-v"} | {
        "torch 1F1B", "torch ZB1P", "torch Interleaved1F1B", "torch InterleavedZB", "torch ZBV"
    }  # fmt: skip
    assert all(r["grad_diff"] < 1e-5 for r in data["fixed"])  # every system the plain model's gradients
    (ratios,) = data["ratios"]
    assert all(ratios[k] > 0 for k in ("1f1b", "zb", "interleaved", "interleaved_zb", "zbv", "fastest"))
    assert "No re-materialization on either side" in (tmp_path / "peers_schedules.md").read_text()


@pytest.mark.timeout(160)
def test_peers_hf_sets_a_huggingface_llama_beside_torchs_schedules(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="peers_hf.py pipelines a HuggingFace Llama: pip install -e '.[hf]'")
    data = run_smoke("peers_hf", tmp_path)
    assert data["command"].startswith("python -m benchmarks.peers_hf --smoke")
    assert (tmp_path / "peers_hf.md").read_text().startswith("#")
    rows = data["fixed"]
    assert {"ours gpipe", "ours 1f1b", "torch GPipe", "torch 1F1B", "plain"} <= {r["system"] for r in rows}
    (ratios,) = data["ratios"]
    assert all(ratios[k] > 0 for k in ("gpipe_torch", "1f1b_torch", "gpipe_el_torch", "1f1b_el_torch"))
    # Same weights and batch: every system's first loss and gradients are the plain HF model's.
    losses = [r["first_loss"] for r in rows]
    assert max(losses) - min(losses) <= 1e-6 * max(losses)
    assert all(r["grad_diff"] <= 1e-6 for r in rows), [(r["system"], r["grad_diff"]) for r in rows]
    # A new length every step: ours and torch's rebuilt schedule give the plain model's loss; built once, torch's
    # schedule fails at the first new length (growing: gloo aborts; shrinking: the loss sees the old shape).
    assert all(r["match"] == "yes" for r in data["variable"]), data["variable"]
    probes = data["torch_built_once"]
    assert set(probes) == {"the run's lengths", "first change shrinks"}
    assert all(p["verdict"].startswith("fails at step 1") for p in probes.values()), probes


@pytest.mark.timeout(160)
def test_interleaved_split_compares_the_two_cuts_side_by_side(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.studies.interleaved_split", "--smoke", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "interleaved_split.json").read_text())
    assert [(r["model"], r["split"]) for r in data["rows"]] == [
        (m, s) for m in ("amoebanet", "transformer") for s in ("per-chunk", "simulated")
    ]
    for r in data["rows"]:
        assert r["median_ms"] > 0 and r["modelled"] > 0, r
        # The paired ratio is over the rounds where both steps were clean, None under 3 of them: on a busy machine
        # (no clean round) the row says so instead of a ratio. What it holds, not how quiet the machine was.
        mine, per_chunk = data["raw"][r["model"]][r["split"]], data["raw"][r["model"]]["per-chunk"]
        clean_rounds = sum(a["clean"] and b["clean"] for a, b in zip(mine, per_chunk, strict=True))
        assert (r["paired"] is None) == (clean_rounds < 3), (r["paired"], clean_rounds)
        assert r["paired"] is None or (isinstance(r["paired"], float) and r["paired"] > 0), r
        assert r["paired"] in (None, 1.0) or r["split"] == "simulated", r
    for model in ("amoebanet", "transformer"):  # the simulated cut is never modelled slower than the per-chunk one
        per_chunk, simulated = (r["modelled"] for r in data["rows"] if r["model"] == model)
        assert simulated <= per_chunk, (model, simulated, per_chunk)


def test_paired_interval_is_the_medians_order_statistics_and_covers_it() -> None:
    """The interval ``overhead.py`` prints beside a paired ratio: the binomial order statistics around the median
    (ranks 7 and 18 of 24), only clean rounds, none under 9 of them, and at least 95 % coverage of the true median."""
    import random

    from benchmarks._lib.machine import paired_interval

    def rounds(ratios: list[float], clean: bool = True) -> tuple[list[dict], list[dict]]:
        return [{"s": r, "clean": clean} for r in ratios], [{"s": 1.0, "clean": True} for _ in ratios]

    assert paired_interval(*rounds([1.0] * 8)) is None
    assert paired_interval(*rounds([1.0] * 30, clean=False)) is None
    shuffled = [float(i) for i in range(1, 25)]
    random.Random(0).shuffle(shuffled)
    assert paired_interval(*rounds(shuffled)) == (7.0, 18.0)
    rng = random.Random(1)
    covered = sum(
        lo <= 1.0 <= hi
        for lo, hi in (paired_interval(*rounds([rng.lognormvariate(0, 0.1) for _ in range(40)])) for _ in range(400))
    )
    assert 0.95 <= covered / 400 < 1.0
