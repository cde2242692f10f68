"""pp = 2 × dp = 2: how much of the data-parallel gradient reduction is left after the pipeline's last backward."""

# What it runs: an MLP backbone of wide Linear layers (a gradient reduction worth measuring) pipelined by GPipeStage
# on 4 processes (gloo on 127.0.0.1, 1 thread each): stages {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}, each
# replica on its own data. Three ways to end a training step, taken by turns, step after step, in one run:
#   after     -- the loss between the phases, then one reduction of every gradient once the backward phase is over
#                (the project before issue 14);
#   drained   -- the loss between the phases; each stage launches its buckets as its own drain ends;
#   in-pipe even -- the loss inside the pipeline (1F1B); each stage's buckets leave during its last backward op, as
#                their gradients end (ReadyBuckets), all of the same size;
#   in-pipe   -- the same, with the last bucket (the stage's first layers, final only as the op ends) cut into
#                buckets of at most 1 MiB (ReadyBuckets' default).
# Per step and replica: visible = (the last stage's reduction done) − (the pipeline's last backward op done), both on
# the one clock of this host; medians over the steps. The same measured from the last backward op of every replica
# leaves out the skew between the replicas (a reduction cannot end before the other replica's gradients exist).
# Writes results/dp_overlap.{json,md}. From the repo root:
#   python -m benchmarks.dp_overlap

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
from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from lightning_gpipe.pipe.dp.grads import BucketedAllReduce, OverlappedReduction
from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets

MODES = ("after", "drained", "in-pipe even", "in-pipe")
COLUMNS = [
    ("bucket_mb", "bucket (MiB)", ".0f"),
    ("mode", "mode", ""),
    ("visible_ms", "visible reduction (ms)", ".1f"),
    ("ratio", "÷ after", ".2f"),
    ("visible_all_ms", "after every replica's last backward (ms)", ".1f"),
    ("ratio_all", "÷ after", ".2f"),
]


def backbone(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def one_step(stage: GPipeStage, mode: str, reducers: tuple, x: torch.Tensor, y: torch.Tensor) -> int:
    """One training step ended the ``mode`` way; returns when this stage's last backward op ended."""
    plain, overlapped, ready, even = reducers
    N, ends, pending = len(x), [], []

    def drained(launch: Any = None) -> None:
        ends.append(time.perf_counter_ns())
        if launch is not None:
            pending.append(launch())

    if mode.startswith("in-pipe"):
        ready = even if mode == "in-pipe even" else ready
        sizes = micro_batch_sizes(N, stage.chunks)
        lo = [sum(sizes[:m]) for m in range(len(sizes))]

        def loss(out: torch.Tensor, m: int) -> torch.Tensor:
            return nn.functional.mse_loss(out, y[lo[m] : lo[m] + sizes[m]]) * sizes[m] / N

        on_drain = lambda: drained(ready.launch_rest)  # noqa: E731
        stage.forward_backward(x, loss, schedule="1f1b", before_last_backward=ready.arm, drained=on_drain)
        pending[0].wait()
        return ends[0]
    out = stage(x)
    if stage.is_last:
        nn.functional.mse_loss(out, y).backward()
    if mode == "after":
        stage.backward(drained=drained)
        plain()
    else:
        stage.backward(drained=lambda: drained(overlapped.start))
        overlapped.finish(pending[0], lambda: None)
    return ends[0]


def run_job(rank: int, world: int, job: dict) -> dict:
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    assert isinstance(pp, dist.ProcessGroup) and isinstance(dp, dist.ProcessGroup), "this rank is in both"
    W, N, M = job["width"], job["batch"], job["chunks"]
    stage = GPipeStage(backbone(W, job["layers"]), chunks=M, group=pp)
    params = list(stage.parameters())
    reducers = {
        mb: (
            BucketedAllReduce(params, dp, int(mb * 2**20)),
            OverlappedReduction(params, [], dp, int(mb * 2**20)),
            ReadyBuckets(params, dp, int(mb * 2**20)),
            ReadyBuckets(params, dp, int(mb * 2**20), tail_bytes=None),
        )
        for mb in job["bucket_mb"]
    }
    cases = [(mode, mb) for mb in job["bucket_mb"] for mode in MODES]
    g = torch.Generator().manual_seed(rank // 2)
    x, y = torch.randn(N, W, generator=g), torch.randn(N, W, generator=g)
    visible: dict[str, list[float]] = {f"{mode} {mb}": [] for mode, mb in cases}
    after_all: dict[str, list[float]] = {f"{mode} {mb}": [] for mode, mb in cases}
    mates = [r for r in range(world) if r // 2 == rank // 2]  # this replica's two stages
    for step in range(job["warmup"] + job["steps"] * len(cases)):
        mode, mb = cases[step % len(cases)]
        stage.zero_grad(set_to_none=True)
        dist.barrier()
        end = one_step(stage, mode, reducers[mb], x, y)
        done = time.perf_counter_ns()
        mine = torch.tensor([end, done], dtype=torch.float64)
        every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, mine)
        if step >= job["warmup"]:
            last_backward = max(float(every[r][0]) for r in mates)
            reduced = max(float(every[r][1]) for r in mates)
            everyones_last = max(float(t[0]) for t in every)
            visible[f"{mode} {mb}"].append((reduced - last_backward) / 1e6)
            after_all[f"{mode} {mb}"].append((reduced - everyones_last) / 1e6)
    per_mode = {m: statistics.median(v) for m, v in visible.items()}
    per_mode |= {f"{m} all": statistics.median(v) for m, v in after_all.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_mode)
    return {"per_rank": gathered}


LABELS = {  # what each mode's bars are, in the figure's legend
    "after": "after the backward phase",
    "drained": "at each stage's drain",
    "in-pipe even": "during the last backward op, even buckets",
    "in-pipe": "during the last backward op, the last bucket cut",
}


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded): visible reduction per mode, a group of bars per bucket size."""
    rows, job = data["rows"], data["job"]
    fig, axes = report.subplots(figsize=(9, 4.2))
    ax = axes[0][0]
    sizes = sorted({r["bucket_mb"] for r in rows}, reverse=True)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for j, mode in enumerate(modes):
        values = [next(r["visible_ms"] for r in rows if r["mode"] == mode and r["bucket_mb"] == mb) for mb in sizes]
        width = 0.8 / len(modes)
        offset = width * (j - (len(modes) - 1) / 2)
        ax.bar([i + offset for i in range(len(sizes))], values, width=width, label=LABELS.get(mode, mode))
    ax.set_xticks(range(len(sizes)), [f"{mb:g} MiB" for mb in sizes])
    ax.set(xlabel="gradient bucket size", ylabel="reduction left after the last backward (ms)")
    report.legend_right(ax, title="buckets launched")
    what = (
        "The data-parallel reduction left after the pipeline's last backward\n"
        f"pp = 2 × dp = 2 on 4 CPU processes, an MLP of {job['layers']} × Linear({job['width']}), "
        f"N = {job['batch']}, M = {job['chunks']}"
    )
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8, help="L, split 4 + 4")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 4.0, 1.0])
    parser.add_argument("--steps", type=int, default=12, help="per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two steps per case")
    args = parser.parse_args()
    if args.smoke:
        args.width, args.steps, args.warmup = 64, 2, 1
    job = {k: getattr(args, k) for k in ("width", "layers", "batch", "chunks", "bucket_mb", "steps", "warmup")}
    result = launch(run_job, 4, job)
    # A replica's visible reduction: the same on its two stages (both take the pipeline's max); average replicas.
    rows = []
    for mb in args.bucket_mb:
        row = {}
        for key, suffix in (("visible_ms", ""), ("visible_all_ms", " all")):
            row[key] = {m: statistics.mean(r[f"{m} {mb}{suffix}"] for r in result["per_rank"]) for m in MODES}
        for mode in MODES:
            v, a = row["visible_ms"], row["visible_all_ms"]
            rows.append(
                {
                    "bucket_mb": mb,
                    "mode": mode,
                    "visible_ms": v[mode],
                    "ratio": v[mode] / v["after"] if v["after"] > 0 else None,
                    "visible_all_ms": a[mode],
                    "ratio_all": a[mode] / a["after"] if a["after"] > 0 else None,
                }
            )
    env = report.environment(threads_per_process=1, processes="4 (pp 2 × dp 2)")
    params_per_stage = args.layers // 2 * (args.width * args.width + args.width)
    md = "\n".join(
        [
            "# pp = 2 × dp = 2: the gradient reduction left after the pipeline's last backward",
            "",
            *report.environment_lines(env),
            f"- Command: `{report.command_line('dp_overlap')}`",
            f"- MLP L = {args.layers} of width {args.width} ({params_per_stage / 1e6:.1f}M parameters per stage), "
            f"N = {args.batch}, M = {args.chunks}; every (bucket size, mode) by turns, {args.steps} steps each, "
            "medians; ÷ after: against the reduction after the backward phase with the same buckets; the last two "
            "columns measure from the last backward op of every replica (the skew between replicas left out)",
            "",
            report.markdown_table(rows, COLUMNS),
        ]
    )
    data = {"command": report.command_line("dp_overlap"), "environment": env, "job": job, "rows": rows, "raw": result}
    paths = report.write("dp_overlap", data, md, out_dir=args.out_dir, plot=plot)
    print(md)
    print(paths)


if __name__ == "__main__":
    main()
