"""GPipe paper Table 2 on CPU processes: training throughput against K stages and M micro-batches, as ratios."""

# What it runs: a small AmoebaNet-D (32×32 images, 10 classes, cross-entropy) and a small Transformer T(L, H, A)
# (random token ids, no padding, cross-entropy on the shifted target), each pipelined by GPipeStage over K
# processes (gloo on 127.0.0.1, 1 thread each, checkpoint="except_last"), for every K in --ks and M in
# --micro-batches, with the same global batch in every row. A step is `barrier; forward + loss + backward; barrier`
# (gradients zeroed before it, no optimizer), timed as the max over ranks; medians over the clean steps after warm-up
# (benchmarks/_lib/machine.py). Balance "time": every layer's forward + backward is profiled once, in this process, on a
# micro-batch of batch/8 samples, and split into K stages by the engine's exact solver. One launch per K runs both
# models and all M. Rows with K > usable cores are flagged: stages then share cores, so they do not measure a
# pipeline. Writes <out-dir>/throughput.{json,md,png}. Run from the repo root: python -m benchmarks.throughput

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import re
import textwrap
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import (
    Runner,
    Timing,
    add_timing_args,
    background_load,
    cpu_snapshot,
    launch,
    measure,
    probe,
    stats,
    wait_quiet,
)
from benchmarks._lib.workloads import PAPER_TABLE2 as PAPER
from benchmarks._lib.workloads import SIZES, SMOKE_SIZES, balances, build, loss_fn, make_batch
from lightning_gpipe.pipe import GPipeStage


# ---------------------------------------------------------------------------------------------------- workers
def train_step(stage: GPipeStage, x: Any, target: torch.Tensor) -> float | None:
    out = stage(x if stage.is_first else None)
    loss = None
    if stage.is_last:
        loss = loss_fn(out, target)
        loss.backward()
    stage.backward()
    return None if loss is None else loss.item()


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One K (= world): every model at every M, each M in a fresh GPipeStage on the same weights."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, probe() if job["probe"] else None)
    out: dict[str, Any] = {"probe_gflops": gathered}
    for name, entry in job["models"].items():
        model, (x, target) = build(name, entry["sizes"]), make_batch(name, entry["sizes"])
        for M in job["micro_batches"]:
            stage = GPipeStage(copy.deepcopy(model), chunks=M, balance=entry["balance"], checkpoint="except_last")
            runner = Runner(partial(stage.zero_grad, set_to_none=True), partial(train_step, stage, x, target))
            t0 = time.perf_counter()
            m = measure({"pipe": runner}, job["timing"])
            out[f"{name}/{M}"] = {
                "records": m.records["pipe"],
                "first_loss": m.first["pipe"],
                "paused_s": m.paused_s,
                "wall_s": time.perf_counter() - t0,
            }
    return out


# ------------------------------------------------------------------------------------------------------- tables
def ideal(K: int, M: int) -> float:
    return K * M / (M + K - 1)


def tabulate(name: str, raw: dict[int, dict], ks: list[int], ms: list[int], batch: int, cores: int) -> list[dict]:
    rows = [
        {"model": name, "K": K, "M": M, **stats(raw[K][f"{name}/{M}"]["records"], batch), **raw[K][f"{name}/{M}"]}
        for K in ks
        for M in ms
    ]
    by = {(r["K"], r["M"]): r for r in rows}
    base = by.get((2, 1))
    for r in rows:
        r.pop("records")
        K, M = r["K"], r["M"]
        one = by.get((1, M))
        r["speedup"] = one["median_ms"] / r["median_ms"] if one else None
        r["ideal"] = ideal(K, M)
        r["speedup_over_ideal"] = r["speedup"] / r["ideal"] if one else None
        r["normalized"] = base["median_ms"] / r["median_ms"] if base else None
        r["paper"] = PAPER[name].get(M, {}).get(K)
        r["oversubscribed"] = K > cores
        r["note"] = ", ".join([w for w, on in (("oversubscribed", r["oversubscribed"]), ("noisy", r["noisy"])) if on])
    return rows


COLUMNS: list[report.Column] = [
    ("K", "K", ""),
    ("M", "M", ""),
    ("median_ms", "median ms/step", ".1f"),
    ("samples_per_s", "samples/s", ".1f"),
    ("speedup", "speed-up vs K=1", ".2f"),
    ("ideal", "ideal K·M/(M+K−1)", ".2f"),
    ("speedup_over_ideal", "speed-up / ideal", ".2f"),
    ("normalized", "normalized to K=2, M=1", ".2f"),
    ("paper", "paper Table 2", ".2f"),
    ("clean_steps", "clean steps", ""),
    ("note", "note", ""),
]


def paper_layout(rows: list[dict], ks: list[int], ms: list[int]) -> str:
    """The paper's layout: K down, M across, 'ours (paper)' normalized throughput in each cell."""
    by = {(r["K"], r["M"]): r for r in rows}

    def cell(K: int, M: int) -> str:
        r = by[(K, M)]
        ours = "–" if r["normalized"] is None else f"{r['normalized']:.2f}"
        ours += "*" if r["oversubscribed"] else ""
        return ours + (f" ({r['paper']:.2f})" if r["paper"] is not None else "")

    table = [{"K": f"K={K}", **{f"M{M}": cell(K, M) for M in ms}} for K in ks]
    return report.markdown_table(table, [("K", "", ""), *[(f"M{M}", f"M={M}", "") for M in ms]])


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded): per model, speed-up over K = 1 against M, beside the ideal.

    None when the run has no K > 1 measured against K = 1.
    """
    rows, ks, ms = data["rows"], data["setup"]["ks"], data["setup"]["micro_batches"]
    models, cores = list(data["models"]), data["usable_cores"]
    pipelines = [K for K in ks if K > 1 and any(r["K"] == K and r["speedup"] is not None for r in rows)]
    if not pipelines:
        return None
    fig, axes = report.subplots(1, len(models), figsize=(5.5 * len(models), 4.6))
    for ax, name in zip(axes[0], models):
        for i, K in enumerate(pipelines):
            color = f"C{i}"
            pts = [r for r in rows if r["model"] == name and r["K"] == K and r["speedup"] is not None]
            over = K > cores
            label = f"K={K} measured" + (" (oversubscribed)" if over else "")
            ax.plot(
                [r["M"] for r in pts], [r["speedup"] for r in pts], "o:" if over else "o-", color=color, label=label
            )
            ax.plot(ms, [ideal(K, M) for M in ms], "--", color=color, alpha=0.6, label=f"K={K} ideal K·M/(M+K−1)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(M) for M in ms])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(textwrap.fill(data["models"][name]["model"], 60), fontsize=9)
        ax.set(xlabel="M (micro-batches per step, same global batch)", ylabel="speed-up over K = 1 at the same M (×)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=len(pipelines), fontsize=8)
    names = " and ".join(re.match(r"[^,(]*(\([^)]*\))?", data["models"][n]["model"]).group(0) for n in models)
    what = f"Throughput (GPipe Table 2) of {names}: K pipeline stages, one CPU process each"
    return report.title(fig, what, data["environment"])


# ------------------------------------------------------------------------------------------------------- driver
def parse_args() -> tuple[argparse.Namespace, Timing]:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.set_defaults(steps=8, max_steps=16, wait_quiet=30.0)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--ks", type=int, nargs="+", metavar="K", help="default 1 2 4; e.g. 1 2 4 8 on 16 cores")
    parser.add_argument("--micro-batches", type=int, nargs="+", metavar="M", help="default 1 4 8 32")
    parser.add_argument("--balance", default="time", choices=["time", "parameters"])
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a quick check: tiny models, K 1 2 and M 1 4 (unless given), 5 steps, no quiet waits, no probe",
    )
    args = parser.parse_args()
    args.ks = args.ks or ([1, 2] if args.smoke else [1, 2, 4])
    args.micro_batches = args.micro_batches or ([1, 4] if args.smoke else [1, 4, 8, 32])
    if args.smoke:
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    args.ks, args.micro_batches = sorted(set(args.ks)), sorted(set(args.micro_batches))
    sizes = SMOKE_SIZES if args.smoke else SIZES
    for name in args.models:
        if any(sizes[name]["batch"] % M for M in args.micro_batches):
            parser.error(f"{name}'s batch {sizes[name]['batch']} is not divisible by every M")
    if min(args.ks) < 1:
        parser.error("K must be ≥ 1")
    return args, timing


def main() -> None:
    args, timing = parse_args()
    torch.set_num_threads(1)  # the profiling below, like the workers, runs on one thread
    t_start = time.perf_counter()
    sizes = SMOKE_SIZES if args.smoke else SIZES
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = report.environment(threads_per_process=1, processes="one per stage (K), gloo on 127.0.0.1")
    print(f"# {env['cpu_model']}, {cores} usable cores, torch {env['torch']}, {env['date']}", flush=True)

    wait_quiet(args.wait_quiet, args.clean_threshold)
    models = {name: balances(name, sizes[name], args.ks, args.balance) for name in args.models}
    for info in models.values():
        print(f"# {info['model']}: {info['parameters']:,} parameters, balance {info['balance']}", flush=True)

    load_before, snap = os.getloadavg(), cpu_snapshot()
    raw: dict[int, dict] = {}
    order: list[str] = []
    for K in args.ks:
        waited = wait_quiet(args.wait_quiet, args.clean_threshold)
        job = {
            "timing": timing,
            "probe": not args.smoke,
            "micro_batches": args.micro_batches,
            "models": {n: {"sizes": sizes[n], "balance": info["balance"][K]} for n, info in models.items()},
        }
        t0 = time.perf_counter()
        raw[K] = launch(run_job, K, job)
        order.append(
            f"K={K}: {', '.join(args.models)} at M={args.micro_batches} ({time.perf_counter() - t0:.0f} s"
            + (f", after waiting {waited:.0f} s for a quiet machine" if waited >= 3 else "")
            + (", oversubscribed" if K > cores else "")
            + ")"
        )
        print(f"# {order[-1]}", flush=True)
    background, background_line = background_load(snap, load_before)

    rows: list[dict] = []
    for name in args.models:
        rows += tabulate(name, raw, args.ks, args.micro_batches, sizes[name]["batch"], cores)
    losses = {
        f"{r['model']} M={r['M']}": max(
            abs(r["first_loss"] - o["first_loss"]) for o in rows if o["M"] == r["M"] and o["model"] == r["model"]
        )
        for r in rows
    }
    total = time.perf_counter() - t_start
    command = report.command_line("throughput")

    md = ["# Throughput against K stages and M micro-batches (GPipe Table 2)", "", *report.environment_lines(env)]
    md += [
        f"- Command: `{command}`; total {total:.0f} s",
        f"- Step: barrier; forward + loss + backward; barrier (max over ranks, no optimizer); checkpoint=except_last; "
        f"{args.warmup} warm-up + median of ≥ {timing.steps} clean steps (≤ {timing.max_steps} timed)",
        f"- Balance: {args.balance}"
        + (
            " (each layer's forward + backward profiled once on batch/8 samples, exact split)"
            if args.balance == "time"
            else " (parameter counts, exact split)"
        ),
        f"- {background_line.lstrip('# ')}",
        "- Probe (512² matmul GFLOP/s per rank, all ranks at once): "
        + (
            "; ".join(f"K={K}: {', '.join(f'{g:.0f}' for g in raw[K]['probe_gflops'])}" for K in args.ks)
            if not args.smoke
            else "skipped (--smoke)"
        ),
        f"- Rows with K > {cores} usable cores are oversubscribed (stages share cores): not a pipeline measurement.",
        "- Speed-up: K=1 time / K time at the same M and the same global batch; ideal K·M/(M+K−1) (GPipe's bubble).",
    ]
    for name, info in models.items():
        part = [r for r in rows if r["model"] == name]
        md += [
            "",
            f"## {name}: {info['model']}",
            "",
            f"{info['parameters']:,} parameters, {len(info['layers'])} "
            f"layers; balance per K: " + ", ".join(f"K={k}: {b}" for k, b in info["balance"].items()),
            "",
        ]
        md += [report.markdown_table(part, COLUMNS), ""]
        one = {r["M"]: r["median_ms"] for r in part if r["K"] == 1}
        if len(one) > 1:
            lo, hi = min(one), max(one)
            md += [
                f"At K=1 a step at M={hi} ({info['sizes']['batch'] // hi} samples per micro-batch) takes "
                f"{one[hi] / one[lo]:.2f}× the M={lo} step: per-micro-batch costs (operator overhead on small "
                "tensors, recomputation) that the normalized figures include and the speed-ups cancel.",
                "",
            ]
        md += [
            "Normalized throughput, ours (paper); * oversubscribed:",
            "",
            paper_layout(part, args.ks, args.micro_batches),
        ]
    md += [
        "",
        "First-step loss, largest difference across K at the same M (same weights and batch): "
        + ", ".join(f"{k} {v:.1e}" for k, v in losses.items()),
    ]

    data = {
        "command": command,
        "environment": env,
        "usable_cores": cores,
        "smoke": args.smoke,
        "setup": {
            "ks": args.ks,
            "micro_batches": args.micro_batches,
            "checkpoint": "except_last",
            "threads_per_process": 1,
            "backend": "gloo, 127.0.0.1",
            "timing": dataclasses.asdict(timing),
            "step_time": "barrier; forward+loss+backward; barrier; max over ranks (grads zeroed before, no optimizer)",
            "order": order,
        },
        "models": models,
        "rows": rows,
        "paper_table2": PAPER,
        "first_loss_max_diff_across_k": losses,
        "machine_check": background,
        "probe_gflops": {K: raw[K]["probe_gflops"] for K in args.ks},
        "total_s": total,
    }
    paths = report.write("throughput", data, "\n".join(md), out_dir=args.out_dir, plot=plot)
    print("\n".join(md[len(report.environment_lines(env)) + 2 :]))
    print(f"# wrote {', '.join(paths.values())} ({total:.0f} s)")


if __name__ == "__main__":
    main()
