"""Inputs received ahead (``Links.receive_ahead``) against each posted where its forward starts, at K=2 on gloo."""

# The two arms alternate step by step in one pair of processes: the transport's posts_ahead (on by default only where
# transfers run in posting order, NCCL) on for "ahead", off for "late".
# Run from the repo root: python -m benchmarks.studies.receive_ahead [--smoke] [--out-dir DIR]

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import Runner, Timing, add_timing_args, launch, measure, stats
from lightning_gpipe.pipe import GPipeStage

WIDTH, LAYERS, BATCH, M = 1024, 8, 256, 8
PATHS = ("fill-drain", "gpipe", "1f1b")


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))


def run_job(rank: int, world: int, job: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    stage = GPipeStage(build_model(), chunks=M, balance=[LAYERS // 2] * 2)
    offsets = [sum(stage.micro_batch_sizes(x)[:m]) for m in range(M + 1)]
    links = stage._executor.links
    assert links is not None, "K = 2"

    def step(path: str, arm: str) -> Any:
        links.transport.posts_ahead = arm == "ahead"
        if path == "fill-drain":
            out = stage(x)
            loss = F.mse_loss(out, y) if stage.is_last else None
            if loss is not None:
                loss.backward()
            stage.backward()
            return None if loss is None else loss.item()

        def loss_fn(out: torch.Tensor, m: int) -> torch.Tensor:
            target = y[offsets[m] : offsets[m + 1]]
            return F.mse_loss(out, target, reduction="sum") / y.numel()

        return sum(float(v) for v in stage.forward_backward(x, loss_fn, schedule=path))

    runners = {
        f"{path}/{arm}": Runner(lambda: stage.zero_grad(set_to_none=True), lambda p=path, a=arm: step(p, a))
        for path in PATHS
        for arm in ("ahead", "late")
    }
    m = measure(runners, job["timing"])
    return {"records": m.records, "first": m.first, "paused_s": m.paused_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=str(report.RESULTS), help="writes receive_ahead.json and .md there")
    where.add_argument("--out", default=None, help="the JSON's path instead (the Markdown beside it, same stem)")
    parser.add_argument("--smoke", action="store_true", help="5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    info = report.environment(threads_per_process=1, processes="2, one per stage (gloo, 127.0.0.1)")
    print(
        f"# {info['cpu_model']}, {info['usable_cores']} usable cores, torch {info['torch']}, {info['date']}\n"
        f"# K=2, M={M}, batch {BATCH}, {LAYERS} layers of width {WIDTH}: {BATCH // M * WIDTH // 256} KiB a boundary",
        flush=True,
    )
    raw = launch(run_job, 2, {"timing": timing})
    rows = {name: stats(recs, BATCH) for name, recs in raw["records"].items()}
    ratios = {path: rows[f"{path}/late"]["median_ms"] / rows[f"{path}/ahead"]["median_ms"] for path in PATHS}
    same = {path: raw["first"][f"{path}/ahead"] == raw["first"][f"{path}/late"] for path in PATHS}
    print(f"{'path/arm':<18} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'clean/timed':>12}")
    for name, r in rows.items():
        print(
            f"{name:<18} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} {r['max_ms']:>9.1f} "
            f"{r['clean_steps']:>5}/{r['timed_steps']:<6}"
        )
    for path in PATHS:
        print(f"{path}: late / ahead {ratios[path]:.3f} (the same first loss: {same[path]})")
    command = report.command_line("studies.receive_ahead")
    out = {"command": command, "environment": info, "rows": rows, "late_over_ahead": ratios, "same_loss": same}
    md = ["# Inputs received ahead vs posted where their forward starts, K=2, gloo", ""]
    md += [*report.environment_lines(info), f"- Command: `{command}`"]
    md += [f"- M={M}, batch {BATCH}, {LAYERS} layers of width {WIDTH}; the arms alternate step by step", ""]
    md += [report.markdown_table([{"run": name, **r} for name, r in rows.items()], COLUMNS), ""]
    md += ["Step time late / ahead: " + ", ".join(f"{p} {ratios[p]:.3f}" for p in PATHS) + "."]
    path = Path(args.out) if args.out else Path(args.out_dir) / "receive_ahead.json"
    paths = report.write(path.stem, out, "\n".join(md), out_dir=path.parent)
    print(f"# wrote {', '.join(paths.values())}")


COLUMNS: list[report.Column] = [
    ("run", "path/arm", ""),
    ("median_ms", "median ms", ".1f"),
    ("min_ms", "min ms", ".1f"),
    ("max_ms", "max ms", ".1f"),
    ("clean_steps", "clean steps", ""),
    ("timed_steps", "timed steps", ""),
]


if __name__ == "__main__":
    main()
