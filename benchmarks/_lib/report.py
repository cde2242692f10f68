"""What every benchmark writes: an environment header, its JSON, a Markdown table and a PNG plot, side by side."""

# Every figure is a pure function of its results file: each benchmark module's ``plot(data)`` takes the loaded JSON
# and returns the figure (or None), so ``python -m benchmarks.report --replot`` redraws the stored results without
# measuring anything again.

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.machine import machine_info, steady_heap

RESULTS = Path(__file__).resolve().parents[1] / "results"


def environment(threads_per_process: int | None = None, processes: str | None = None) -> dict:
    """``machine_info`` plus what a reader needs to compare runs: accelerator, Lightning version, threads, launch,
    and the heap, which it settles in this process first (``steady_heap``: what a benchmark measures in-process then
    runs on the heap its workers have)."""
    info = machine_info()
    try:  # the version without importing Lightning (seconds on a busy machine)
        info["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        info["lightning"] = None
    info["accelerator"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    info["threads_per_process"] = threads_per_process if threads_per_process is not None else torch.get_num_threads()
    info["processes"] = processes
    info["heap"] = steady_heap()
    return info


def command_line(name: str) -> str:
    """How this run was started, as typed from the repo root: ``python -m benchmarks.<name>`` and its arguments."""
    return shlex.join(["python", "-m", f"benchmarks.{name}", *sys.argv[1:]])


def environment_lines(env: dict) -> list[str]:
    """The environment as Markdown lines for the top of a results table."""
    lines = [
        f"- Machine: {env['cpu_model']}, {env['usable_cores']} usable cores, accelerator: {env['accelerator']}",
        f"- torch {env['torch']}, lightning {env.get('lightning')}, Python {env['python']}",
        f"- Threads per process: {env['threads_per_process']}; processes: {env.get('processes') or '-'}; "
        f"heap: {env.get('heap', 'glibc')} (benchmarks/_lib/machine.py, STEADY_HEAP)",
        f"- Engine commit {env['engine_commit']}, {env['date']}",
    ]
    return lines


Column = tuple[str, str, str]  # (key in the row, header, format spec such as ".2f"; "" for str())


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A GitHub Markdown table; numbers right-aligned, missing values as '–'."""

    def cell(row: dict, key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "–"
        if fmt and isinstance(value, (int, float)):
            return format(value, fmt)
        return str(value)

    numeric = [any(isinstance(r.get(k), (int, float)) for r in rows) for k, _, _ in columns]
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---:" if n else "---" for n in numeric) + "|"
    body = ["| " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def write(
    name: str,
    data: dict,
    markdown: str,
    figure: Any = None,
    out_dir: str | os.PathLike | None = None,
    plot: Callable[[dict], Any] | None = None,
) -> dict:
    """``results/<name>.json``, ``.md`` and ``.png``; returns the paths.

    The PNG is ``plot(data)`` drawn from the JSON as written (so a later ``--replot`` draws the same figure), or
    ``figure`` when given instead; none when both are None or ``plot`` returns None.
    """
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    text = json.dumps(data, indent=1, default=str)
    paths["json"].write_text(text)
    paths["md"].write_text(markdown.rstrip() + "\n")
    if figure is None and plot is not None:
        figure = plot(json.loads(text))
    if figure is not None:
        paths["png"] = out / f"{name}.png"
        save(figure, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def save(figure: Any, path: str | os.PathLike) -> None:
    """The PNG of a figure, cropped to what it draws (legends outside the axes included), then the figure closed."""
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(figure)


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------------ figures
def machine_label(env: dict) -> str:
    """The machine a results file was measured on, for a figure's title: cores, CPU, GPU (if any), torch, date."""
    cpu = re.sub(r"\s*\((R|TM)\)", "", env.get("cpu_model") or "unknown CPU")
    label = f"{env.get('usable_cores', '?')}-core {cpu}"
    accelerator = env.get("accelerator")
    if accelerator and accelerator != "cpu":
        label += f" (GPU host: {accelerator})"
    torch_version = str(env.get("torch", "?")).split("+")[0]
    return f"{label}, torch {torch_version}, {str(env.get('date', ''))[:10]}"


def subplots(rows: int = 1, cols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots`` on the Agg backend with constrained layout (titles and outside legends kept clear)."""
    kwargs.setdefault("squeeze", False)
    return pyplot().subplots(rows, cols, layout="constrained", **kwargs)


def title(fig: Any, what: str, env: dict) -> Any:
    """The figure's title: what it shows, then the machine it was measured on (``machine_label``)."""
    fig.suptitle(f"{what}\n{machine_label(env)}", fontsize=11)
    return fig


def legend_right(ax: Any, **kwargs: Any) -> Any:
    """The axes' legend outside it, on its right, top-aligned: never over the data."""
    kwargs.setdefault("fontsize", 8)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def columns(spec: str) -> list[Column]:
    """Table columns written as "key|header|format; ..." (``markdown_table``'s column tuples)."""
    out: list[Column] = []
    for c in spec.split(";"):
        key, header, fmt = c.strip().split("|")
        out.append((key, header, fmt))
    return out
