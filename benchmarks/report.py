"""Redraw the benchmarks' figures from their stored results alone: python -m benchmarks.report --replot."""

# The writer every benchmark uses is benchmarks/_lib/report.py; this is the command that redraws what it wrote:
#   python -m benchmarks.report --replot            # every benchmarks/results/**/<name>.json that has a figure

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from benchmarks._lib.report import RESULTS, save

# The stem of a results file (less a "_run<N>" suffix: another run of the same command) -> the module whose
# ``plot(data)`` draws its figure. Results without a figure (engine_speed, output_modes, dp_cost_model, traces) are
# absent.
FIGURES = {
    name: f"benchmarks.{name}"
    for name in (
        "throughput",
        "peers",
        "peers_hf",
        "memory",
        "overhead",
        "consistency",
        "partition",
        "dp_overlap",
        "fsdp",
    )
} | {"memory_schedules": "benchmarks._lib.memory_schedules"}  # memory.py --schedules


def figure_module(path: str | os.PathLike) -> ModuleType | None:
    """The benchmark module that draws ``path``'s figure, or None when that results file has none."""
    name = FIGURES.get(re.sub(r"_run\d+$", "", Path(path).stem))
    return importlib.import_module(name) if name else None


def replot(results: str | os.PathLike = RESULTS, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Redraw every figure under ``results`` from its JSON alone (into ``out_dir``, same layout; default in place).

    Returns the PNGs written. A module may also have ``replot_extra(data, out)`` for figures beside the main one.
    """
    results = Path(results)
    written: list[Path] = []
    for path in sorted(results.rglob("*.json")):
        module = figure_module(path)
        if module is None:
            continue
        data = json.loads(path.read_text())
        out = (Path(out_dir) / path.parent.relative_to(results)) if out_dir is not None else path.parent
        out.mkdir(parents=True, exist_ok=True)
        fig = module.plot(data)
        if fig is not None:
            save(fig, out / f"{path.stem}.png")
            written.append(out / f"{path.stem}.png")
        if hasattr(module, "replot_extra"):
            written += module.replot_extra(data, out)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Redraw the benchmarks' figures from their stored JSON results.")
    parser.add_argument("--replot", action="store_true", help="redraw every figure from its results file")
    parser.add_argument("--results", default=str(RESULTS), help="the results folder (searched recursively)")
    parser.add_argument("--out-dir", default=None, help="write the PNGs here (same layout) instead of in place")
    args = parser.parse_args(argv)
    if not args.replot:
        parser.error("nothing to do: pass --replot")
    for png in replot(args.results, args.out_dir):
        print(f"# wrote {png}")


if __name__ == "__main__":
    main()
