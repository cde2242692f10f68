"""What every benchmark writes: an environment header, its JSON, a Markdown table and a PNG plot, side by side."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import machine_info

RESULTS = Path(__file__).resolve().parent / "results"


def environment(threads_per_process: int | None = None, processes: str | None = None) -> dict:
    """``machine_info`` plus what a reader needs to compare runs: accelerator, Lightning version, threads, launch."""
    info = machine_info()
    try:  # the version without importing Lightning (seconds on a busy machine)
        info["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        info["lightning"] = None
    info["accelerator"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    info["threads_per_process"] = threads_per_process if threads_per_process is not None else torch.get_num_threads()
    info["processes"] = processes
    return info


def command_line(name: str) -> str:
    """How this run was started, as typed from the repo root: ``python -m benchmarks.<name>`` and its arguments."""
    return shlex.join(["python", "-m", f"benchmarks.{name}", *sys.argv[1:]])


def environment_lines(env: dict) -> list[str]:
    """The environment as Markdown lines for the top of a results table."""
    lines = [
        f"- Machine: {env['cpu_model']}, {env['usable_cores']} usable cores, accelerator: {env['accelerator']}",
        f"- torch {env['torch']}, lightning {env.get('lightning')}, Python {env['python']}",
        f"- Threads per process: {env['threads_per_process']}; processes: {env.get('processes') or '-'}",
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


def write(name: str, data: dict, markdown: str, figure: Any = None, out_dir: str | os.PathLike | None = None) -> dict:
    """``results/<name>.json``, ``.md`` (and ``.png`` if ``figure`` is a matplotlib figure); returns the paths."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=str))
    paths["md"].write_text(markdown.rstrip() + "\n")
    if figure is not None:
        paths["png"] = out / f"{name}.png"
        figure.savefig(paths["png"], dpi=120, bbox_inches="tight")
    return {k: str(v) for k, v in paths.items()}


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
