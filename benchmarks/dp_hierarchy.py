"""Flat vs hierarchical data-parallel reduction, timed on 4 processes as 2 simulated nodes × 2 (equal links)."""

# What it runs: 4 processes (gloo on 127.0.0.1, one thread each) are one data-parallel group of 4 replicas, ranks
# {0, 1} on "node" 0 and {2, 3} on "node" 1. Each holds the gradients of one stage (`--mb` MiB of fp32 in tensors of
# 1 MiB) and averages them with BucketedAllReduce, flat (one all-reduce per bucket over the 4) or hierarchical
# (Jizhi's: reduce within the node, all-reduce between the 2 leaders, broadcast within the node), by turns, for each
# bucket size. Per reduction: the slowest rank's time; medians. Here every link is the same loopback, so this
# measures what the hierarchy's extra steps cost where nothing is slow; the gain it buys on a slow inter-node link
# is the cost model's (`dp_cost_model.py`). Also the largest difference between the two means (fp32 rounding).
# Writes results/dp_hierarchy.{json,md,png}. From the repo root:
#   python -m benchmarks.dp_hierarchy

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import launch
from lightning_gpipe.pipe.dp.grads import BucketedAllReduce
from lightning_gpipe.pipe.dp.hierarchy import build_hierarchies

MODES = ("flat", "hierarchical")
COLUMNS = [
    ("bucket_mb", "bucket (MiB)", ".0f"),
    ("flat_ms", "flat (ms)", ".1f"),
    ("hierarchical_ms", "hierarchical (ms)", ".1f"),
    ("ratio", "hierarchical ÷ flat", ".2f"),
    ("max_diff", "max abs difference of the means", ".1e"),
]


def run_job(rank: int, world: int, job: dict) -> dict:
    dp = dist.new_group(list(range(world)))
    hierarchy = build_hierarchies([list(range(world))], lambda r: r // 2, rank)
    g = torch.Generator().manual_seed(rank)
    numel = 2**18  # 1 MiB of fp32 per tensor
    params = [nn.Parameter(torch.zeros(numel)) for _ in range(max(1, int(job["mb"])))]
    grads = [torch.randn(numel, generator=g) for _ in params]
    times: dict[str, list[float]] = {f"{m} {mb}": [] for mb in job["bucket_mb"] for m in MODES}
    max_diff = {}
    for mb in job["bucket_mb"]:
        reducers = {
            "flat": BucketedAllReduce(params, dp, int(mb * 2**20)),
            "hierarchical": BucketedAllReduce(params, dp, int(mb * 2**20), hierarchy=hierarchy),
        }
        means = {}
        for i in range(job["warmup"] + job["repeats"] * len(MODES)):
            mode = MODES[i % len(MODES)]
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
            dist.barrier(group=dp)
            start = time.perf_counter()
            reducers[mode]()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=dp)
            if i >= job["warmup"]:
                times[f"{mode} {mb}"].append(float(took) * 1e3)
            means[mode] = torch.cat([p.grad for p in params])  # type: ignore[misc]
        max_diff[str(mb)] = float((means["flat"] - means["hierarchical"]).abs().max())
    return {"median_ms": {k: statistics.median(v) for k, v in times.items()}, "max_diff": max_diff}


def plot(data: dict) -> Any:
    """Median reduction time per bucket size, flat and hierarchical, from a results file's JSON."""
    rows, job = data["rows"], data["job"]
    fig, axes = report.subplots(figsize=(8, 4))
    ax = axes[0][0]
    labels = [f"{r['bucket_mb']:g} MiB" for r in rows]
    for j, mode in enumerate(MODES):
        ax.bar([i + 0.35 * (j - 0.5) for i in range(len(rows))], [r[f"{mode}_ms"] for r in rows], 0.35, label=mode)
    ax.set_xticks(range(len(rows)), labels)
    ax.set(xlabel="gradient bucket size", ylabel="one reduction, median (ms)")
    report.legend_right(ax, title="dp_reduction")
    what = (
        "Flat vs hierarchical data-parallel reduction on equal links (no slow inter-node link to save)\n"
        f"4 CPU processes as 2 nodes × 2 replicas, {job['mb']:g} MiB of fp32 gradients"
    )
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=32.0, help="MiB of gradients per replica")
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 4.0, 1.0])
    parser.add_argument("--repeats", type=int, default=15, help="per mode and bucket size")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="2 MiB, two repeats")
    args = parser.parse_args()
    if args.smoke:
        args.mb, args.bucket_mb, args.repeats, args.warmup = 2.0, [1.0], 2, 1
    job = {k: getattr(args, k) for k in ("mb", "bucket_mb", "repeats", "warmup")}
    result = launch(run_job, 4, job)
    rows = []
    for mb in args.bucket_mb:
        flat, hier = (result["median_ms"][f"{m} {mb}"] for m in MODES)
        rows.append(
            {
                "bucket_mb": mb,
                "flat_ms": flat,
                "hierarchical_ms": hier,
                "ratio": hier / flat,
                "max_diff": result["max_diff"][str(mb)],
            }
        )
    env = report.environment(threads_per_process=1, processes="4 (dp 4 as 2 nodes × 2)")
    md = "\n".join(
        [
            "# Flat vs hierarchical data-parallel reduction, 2 simulated nodes × 2 (equal links)",
            "",
            *report.environment_lines(env),
            f"- Command: `{report.command_line('dp_hierarchy')}`",
            f"- {args.mb:g} MiB of fp32 gradients per replica; the two modes by turns, {args.repeats} reductions each "
            "per bucket size; the slowest rank's time, medians",
            "",
            report.markdown_table(rows, COLUMNS),
        ]
    )
    data = {"command": report.command_line("dp_hierarchy"), "environment": env, "job": job, "rows": rows}
    paths = report.write("dp_hierarchy", data, md, out_dir=args.out_dir, plot=plot)
    print(md)
    print(paths)


if __name__ == "__main__":
    main()
