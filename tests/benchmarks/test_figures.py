"""Every stored figure is drawn from its results file alone: the plotted values are the file's numbers in the unit
the axis names, every axis has a label, the title names the machine, and no legend covers the data or the title."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report  # the --replot command: which module draws which results file
from benchmarks._lib import report as writer  # what draws and labels the figures
from tests.helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20


def kind(path: Path) -> str | None:
    """The benchmark whose figure a results file has (``report.FIGURES``), or None."""
    return next((k for k in report.FIGURES if re.fullmatch(rf"{k}(_run\d+)?", path.stem)), None)


FILES = sorted(p for p in RESULTS.rglob("*.json") if kind(p))


def draw(path: Path, tmp_path: Path) -> tuple[Any, dict]:
    """The figure of a stored results file, drawn by its module's ``plot`` and saved as a PNG into ``tmp_path``."""
    data = json.loads(path.read_text())
    fig = report.figure_module(path).plot(data)
    assert fig is not None, path
    png = tmp_path / f"{path.stem}.png"
    fig.savefig(png, dpi=60, bbox_inches="tight")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig.canvas.draw()  # the layout as drawn, for the extents below
    return fig, data


def close(a: list[float], b: list[float], tol: float = 1e-9) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def heights(container: Any) -> list[float]:
    return [p.get_height() for p in container]


def by_label(ax: Any) -> dict[str, Any]:
    """The axes' bar containers by their legend label."""
    return {c.get_label(): c for c in ax.containers}


def lines_by_label(ax: Any) -> dict[str, Any]:
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def ydata(line: Any) -> list[float]:
    return [float(y) for y in line.get_ydata()]


# ------------------------------------------------------------------------------------- what each figure plots
def check_overhead(fig: Any, data: dict) -> None:
    """Stacked shares of the step, in %: 100 × the median of the raw steps' fractions, summing to about 100."""
    (ax,) = fig.axes
    bars = by_label(ax)
    assert ax.get_xlabel() == "share of the step (%)"
    totals = [0.0] * len(data["rows"])
    for i, r in enumerate(data["rows"]):
        entry = data["raw"][str(r["K"])][r["model"]]
        steps = (entry if "steps" in entry else entry[r["path"]])["steps"]
        clean = [s for s in steps if s["clean"]]
        use = clean if len(clean) >= 3 else steps
        for key in ("forward", "backward", "recompute", "loss", "waiting", "transfer", "update", "other"):
            if key not in steps[0]:
                assert key not in bars
                continue
            width = bars[key][i].get_width()
            assert width == pytest.approx(100 * statistics.median(s[key] for s in use), rel=1e-9, abs=1e-9), key
            if key in ("forward", "backward", "recompute", "transfer", "update"):  # stored as % in every file
                assert width == pytest.approx(r[key], rel=1e-9, abs=1e-9), key
            totals[i] += width
    # Disjoint parts of one step in one unit: their medians add up to about the whole step, which the axis shows.
    assert all(95.0 <= t <= 102.0 for t in totals), totals
    assert ax.get_xlim()[1] >= max(totals) - 1e-9  # the plot sums the widths in another order


def check_throughput(fig: Any, data: dict) -> None:
    """Per model: the measured speed-up over K = 1 and the ideal K·M/(M+K−1), against M."""
    models = list(data["models"])
    assert len(fig.axes) == len(models)
    for ax, name in zip(fig.axes, models):
        assert data["models"][name]["model"][:20] in ax.get_title().replace("\n", " ")
        lines = lines_by_label(ax)
        for K in sorted({r["K"] for r in data["rows"] if r["K"] > 1}):
            pts = sorted((r["M"], r["speedup"]) for r in data["rows"] if r["model"] == name and r["K"] == K)
            measured = next(line for label, line in lines.items() if label.startswith(f"K={K} measured"))
            assert close([float(x) for x in measured.get_xdata()], [float(m) for m, _ in pts])
            assert close(ydata(measured), [s for _, s in pts])
            ms = data["setup"]["micro_batches"]
            assert close(ydata(lines[f"K={K} ideal K·M/(M+K−1)"]), [K * M / (M + K - 1) for M in ms])
    assert "AmoebaNet-D" in fig._suptitle.get_text() and "Transformer" in fig._suptitle.get_text()


def check_peers(fig: Any, data: dict) -> None:
    """Samples/s per system and M; tokens/s at variable lengths; no raw error text, only a one-line note."""
    left, right = fig.axes
    bars = by_label(left)
    ms = list(dict.fromkeys(r["M"] for r in data["fixed"]))
    for name in dict.fromkeys(r["system"] for r in data["fixed"]):
        expected = [next(r["samples_per_s"] for r in data["fixed"] if r["system"] == name and r["M"] == M) for M in ms]
        assert close(heights(bars[name]), expected), name
    assert close([p.get_height() for p in right.patches], [r["tokens_per_s"] for r in data["variable"]])
    texts = [t for t in (*fig.texts, *left.texts, *right.texts) if t is not fig._suptitle]
    for t in texts:
        for line in t.get_text().splitlines():
            assert len(line) <= 80 and "gloo" not in line and "pair.cc" not in line, line
    # The full error text stays in the JSON.
    assert all(len(p["verdict"]) > len(p["short"]) for p in data["torch_built_once"].values())


def check_memory(fig: Any, data: dict) -> None:
    """Per model: model memory and peak activation per stage (MiB, stacked); the largest size per configuration."""
    for name, res in data["results"].items():
        (top,) = [ax for ax in fig.axes if ax.get_title().startswith(f"{name},")]
        (bottom,) = [ax for ax in fig.axes if ax.get_title().startswith(f"{name}: largest")]
        stages = [s for r in res["table"] for s in r["stages"]]
        model, act = top.containers
        assert close(heights(model), [s["model_bytes"] / MIB for s in stages])
        assert close(heights(act), [s["peak_activation_bytes"] / MIB for s in stages])
        assert close([p.get_y() for p in act], [s["model_bytes"] / MIB for s in stages])
        assert "MiB" in top.get_ylabel() and "stage" in top.get_xlabel()
        found = [f["largest"] for f in res["largest"].values() if f["largest"] is not None]
        assert close(heights(bottom.containers[0]), [float(x) for x in found])


def check_memory_schedules(fig: Any, data: dict) -> None:
    """Peak activation per stage (MiB) under GPipe and 1F1B."""
    (ax,) = fig.axes
    bars = by_label(ax)
    assert close(heights(bars["GPipe"]), [r["gpipe_mb"] for r in data["memory"]])
    assert close(heights(bars["1F1B"]), [r["1f1b_mb"] for r in data["memory"]])
    assert "MiB" in ax.get_ylabel()


def check_consistency(fig: Any, data: dict) -> None:
    """Per reference run: the loss curves at every K, and |loss_K − loss_1| (0 drawn at 1e-9)."""
    groups = [r["name"] for r in data["runs"] if not r["ref"] and r["name"] in data["curves"]]
    assert len(fig.axes) == 2 * len(groups)
    for i, group in enumerate(groups):
        left, right = fig.axes[2 * i], fig.axes[2 * i + 1]
        members = [r["name"] for r in data["runs"] if (r["ref"] or r["name"]) == group]
        curves = [c["loss"] for n in members for _, c in sorted(data["curves"][n].items(), key=lambda kv: int(kv[0]))]
        assert [ydata(line) for line in left.get_lines()] == curves
        diffs = [
            [max(x, 1e-9) for x in d["abs"]]
            for n in members
            for _, d in sorted(data["diffs"].get(n, {}).items(), key=lambda kv: int(kv[0]))
        ]
        assert [ydata(line) for line in right.get_lines()] == diffs


def check_partition(fig: Any, data: dict) -> None:
    """Per layer, its share (%) of the model's parameters, FLOPs and time; per split, the costliest stage / mean."""
    left, right = fig.axes
    name, layers = next(iter(data["per_layer"].items()))
    for key, line in zip([k for k in ("parameters", "flops", "time_rated") if k in layers], left.get_lines()):
        assert close(ydata(line), [100 * c / sum(layers[key]) for c in layers[key]]), key
    rows = [r for r in data["rows"] if r["model"] == name]
    bars = by_label(right)
    assert close(heights(bars["in FLOPs"]), [r["flops_ratio"] for r in rows])
    assert close(heights(bars["in measured time"]), [r["time_ratio"] for r in rows])


def check_dp_overlap(fig: Any, data: dict) -> None:
    """The reduction left after the last backward (ms) per mode, a group per bucket size."""
    (ax,) = fig.axes
    sizes = sorted({r["bucket_mb"] for r in data["rows"]}, reverse=True)
    modes = list(dict.fromkeys(r["mode"] for r in data["rows"]))
    value = {(r["mode"], r["bucket_mb"]): r["visible_ms"] for r in data["rows"]}
    for mode, container in zip(modes, ax.containers):
        assert close(heights(container), [value[mode, mb] for mb in sizes]), mode
    assert "(ms)" in ax.get_ylabel()


def check_fsdp(fig: Any, data: dict) -> None:
    """Bytes held per rank: ddp's whole, fsdp's parameters, gradients and AdamW states stacked (MB); the engine's step
    per mode (ms): its parts stacked up to the step's median."""
    held, times = fig.axes
    rows = data["held"]
    bars = by_label(held)
    assert close(heights(bars["ddp"]), [r["ddp_mb"] for r in rows])
    parts = ("fsdp: parameters", "fsdp: gradients", "fsdp: AdamW states")
    for label, key in zip(parts, ("fsdp_params_mb", "fsdp_grads_mb", "fsdp_states_mb")):
        assert close(heights(bars[label]), [r[key] for r in rows]), label
    tops = [sum(v) for v in zip(*(heights(bars[label]) for label in parts))]
    assert close(tops, [r["fsdp_mb"] for r in rows], tol=1e-6)
    assert "(MB)" in held.get_ylabel()
    bars = by_label(times)
    for label, key in (("blocked in all-gathers", "gather_ms"), ("AdamW step", "optimizer_ms")):
        assert close(heights(bars[label]), [r[key] for r in data["time"]]), label
    stacked = [sum(v) for v in zip(*(heights(c) for c in times.containers))]
    assert close(stacked, [r["median_ms"] for r in data["time"]], tol=1e-6)
    assert "(ms)" in times.get_ylabel()


CHECKS = {
    "overhead": check_overhead,
    "throughput": check_throughput,
    "peers": check_peers,
    "peers_hf": check_peers,  # the same figure: samples/s per system and M, tokens/s at variable lengths
    "memory": check_memory,
    "memory_schedules": check_memory_schedules,
    "consistency": check_consistency,
    "partition": check_partition,
    "dp_overlap": check_dp_overlap,
    "fsdp": check_fsdp,
}


# --------------------------------------------------------------------------------------- what every figure has
def check_stands_alone(fig: Any, data: dict) -> None:
    """A title naming the machine, a label on every axis, every legend clear of the axes and of the title."""
    env = data["environment"]
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    assert writer.machine_label(env) in title
    assert f"{env['usable_cores']}-core" in title and env["cpu_model"].split()[0].split("(")[0] in title
    for ax in fig.axes:
        assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), ax.get_title()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), (legend.get_texts()[0].get_text(), ax.get_title())
        assert not box.overlaps(fig._suptitle.get_window_extent(renderer))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(RESULTS)) for p in FILES])
def test_stored_figure_plots_the_results_file(path: Path, tmp_path: Path) -> None:
    fig, data = draw(path, tmp_path)
    try:
        check_stands_alone(fig, data)
        CHECKS[kind(path)](fig, data)
    finally:
        writer.pyplot().close(fig)


@pytest.mark.timeout(60)
def test_every_figure_has_a_check_and_a_stored_file() -> None:
    assert set(CHECKS) == set(report.FIGURES)
    assert {kind(p) for p in FILES} == set(report.FIGURES)
    for path in FILES:  # and the stored PNG beside it, which --replot redraws
        assert path.with_suffix(".png").exists(), path


@pytest.mark.timeout(60)
def test_the_value_check_fails_on_a_fraction_plotted_among_percentages(tmp_path: Path) -> None:
    """The old overhead figure stacked the rows as stored: in the 16-core file ``waiting`` is a fraction (0.17) beside
    percentages, so its bars stopped at 38-83 %. The check catches it."""
    data = json.loads((RESULTS / "xeon16" / "overhead.json").read_text())
    fig, axes = writer.subplots(figsize=(8, 4))
    ax = axes[0][0]
    labels = [f"{r['model']} K={r['K']}" for r in data["rows"]]
    left = [0.0] * len(labels)
    for key in ("forward", "backward", "recompute", "waiting", "transfer", "update", "other"):
        values = [r[key] for r in data["rows"]]
        ax.barh(labels, values, left=left, label=key)
        left = [a + b for a, b in zip(left, values)]
    ax.set(xlabel="share of the step (%)", ylabel="model, K")
    writer.legend_right(ax)
    writer.title(fig, "the old overhead figure", data["environment"])
    fig.canvas.draw()
    try:
        check_stands_alone(fig, data)  # titled and labelled: only the values are wrong
        with pytest.raises(AssertionError):
            check_overhead(fig, data)
    finally:
        writer.pyplot().close(fig)


@pytest.mark.timeout(60)
def test_replot_redraws_the_figures_from_the_json_alone(tmp_path: Path) -> None:
    src, out = tmp_path / "results", tmp_path / "out"
    (src / "xeon16").mkdir(parents=True)
    shutil.copy(RESULTS / "dp_overlap.json", src / "dp_overlap.json")
    shutil.copy(RESULTS / "memory_schedules.json", src / "xeon16" / "memory_schedules_run2.json")
    shutil.copy(RESULTS / "output_modes.json", src / "output_modes.json")  # no figure: skipped
    report.main(["--replot", "--results", str(src), "--out-dir", str(out)])
    pngs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert pngs == ["dp_overlap.png", "xeon16/memory_schedules_run2.png"]
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
