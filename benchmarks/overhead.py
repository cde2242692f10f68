"""GPipe paper Table 4 from the timeline: where a pipelined step's time goes, as shares, for K = 2 and K = 4."""

# What it runs: throughput.py's small AmoebaNet-D and Transformer (workloads.py), pipelined by GPipeStage over K
# processes (gloo on 127.0.0.1, 1 thread each, checkpoint="except_last", time-profiled balance), a training step =
# forward + loss + backward + RMSProp update, with the stage's timeline on. Each step is traced on every stage (clocks
# lined up after a barrier), then broken down by lightning_gpipe.pipe.trace_stats.breakdown: recompute, bubble
# (pipeline time in which a stage computes nothing), load imbalance, transfer (the part of receive waits after the
# peer sent), the weight update, as shares of the step; medians over the clean traced steps. One Gantt chart per
# configuration. Writes <out-dir>/overhead.{json,md,png} and overhead_<model>_k<K>.png. Run from the repo root:
#   python -m benchmarks.overhead

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import report
from benchmarks.machine import launch, pause_until_quiet, timed, wait_quiet
from benchmarks.workloads import SIZES, SMOKE_SIZES, balances, build, loss_fn, make_batch
from lightning_gpipe.pipe import GPipeStage, breakdown, gather_events
from lightning_gpipe.pipe.gantt import plot_timeline
from lightning_gpipe.pipe.trace import Event

# Disjoint shares of the whole step (first event to last on any stage, averaged over stages), in stacking order:
# compute, then the bubble split into waiting for a peer's compute and the transfer itself, then what lies outside
# the pipeline's span (the update, and the rest: the loss, the loop).
STACK = ("forward", "backward", "recompute", "waiting", "transfer", "update", "other")
# Table 4's columns: the bubble whole, and load imbalance -- a cause of part of the bubble, not a share beside it.
SHARES = ("forward", "backward", "recompute", "bubble", "transfer", "load_imbalance", "update", "other")


def traced_step(stage: GPipeStage, optimizer: torch.optim.Optimizer, x: Any, target: torch.Tensor) -> list:
    """One training step with the timeline on; every stage's events, lined up at the step's start (a collective)."""
    timeline = stage.timeline
    timeline.clear()
    timeline.enabled = True
    origin = time.perf_counter_ns()  # just after timed()'s barrier: the same moment on every stage
    out = stage(x if stage.is_first else None)
    if stage.is_last:
        loss_fn(out, target).backward()
    stage.backward()
    start = time.perf_counter_ns()
    optimizer.step()
    timeline.events.append(Event("update", stage.index, -1, start, time.perf_counter_ns()))
    timeline.enabled = False
    return gather_events(timeline, origin_ns=origin)


def step_shares(events: list) -> dict[str, float]:
    b = breakdown(events)
    span, p_span = b["span_ms"], b["pipeline_span_ms"]
    shares = {kind: b["shares"][kind] for kind in ("forward", "backward", "recompute", "transfer", "update")}
    # The bubble and the imbalance are fractions of the pipeline's span; here, shares of the whole step.
    bubble = b["bubble"] * p_span / span
    return {
        "span_ms": span,
        **shares,
        "bubble": bubble,
        "waiting": bubble - shares["transfer"],
        "other": (span - p_span) / span - shares["update"],
        "load_imbalance": b["load_imbalance"] * p_span / span,
        "bubble_of_pipeline": b["bubble"],
        "theoretical_bubble": b["theoretical_bubble"],
        "efficiency": b["efficiency"],
    }


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One K (= world): every model, ``steps`` clean traced steps each (at most ``max_steps``)."""
    out: dict[str, Any] = {}
    for name, entry in job["models"].items():
        torch.manual_seed(0)
        stage = GPipeStage(build(name, entry["sizes"]), chunks=job["M"], balance=entry["balance"])
        optimizer = torch.optim.RMSprop(stage.parameters(), lr=1e-4)
        x, target = make_batch(name, entry["sizes"])
        steps: list[dict] = []
        chart: list | None = None
        for s in range(job["warmup"] + job["max_steps"]):
            stage.zero_grad(set_to_none=True)
            rec, events = timed(lambda: traced_step(stage, optimizer, x, target))  # noqa: B023
            clean = rec["foreign_cores"] < job["clean_threshold"]
            if s >= job["warmup"] and rank == 0:
                steps.append({**step_shares(events), "clean": clean, "foreign_cores": rec["foreign_cores"]})
                chart = events if clean or chart is None else chart
            done = torch.tensor([sum(st["clean"] for st in steps) >= job["steps"]], dtype=torch.float64)
            dist.broadcast(done, src=0)
            if done.item():
                break
            if not clean and job["wait_quiet"] > 0:
                pause_until_quiet(job["wait_quiet"], job["clean_threshold"])
        if rank == 0:
            title = name
            path = Path(job["out_dir"]) / f"overhead_{name}_k{world}.png"
            plot_timeline(chart, path, title=title)
            out[name] = {"steps": steps, "gantt": str(path)}
    return out


def summarize(steps: list[dict]) -> dict[str, Any]:
    clean = [s for s in steps if s["clean"]]
    use = clean if len(clean) >= 3 else steps
    keys = (*SHARES, "waiting", "span_ms", "bubble_of_pipeline", "efficiency")
    row = {key: statistics.median(s[key] for s in use) for key in keys}
    return {**row, "theoretical_bubble": steps[0]["theoretical_bubble"], "n": len(use), "clean": len(clean)}


COLUMNS: list[report.Column] = [
    ("model", "model", ""),
    ("K", "K", ""),
    ("M", "M", ""),
    ("span_ms", "step ms", ".0f"),
    *[(key, f"{key.replace('_', ' ')} %", ".1f") for key in SHARES],
    ("bubble_of_pipeline", "bubble % of pipeline", ".1f"),
    ("theoretical_bubble", "(K−1)/(M+K−1) %", ".1f"),
    ("efficiency", "efficiency (ideal GPipe step / step)", ".2f"),
    ("n", "steps", ""),
    ("note", "note", ""),
]


def figure(rows: list[dict]) -> Any:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    labels = [f"{r['model']}\nK={r['K']}" for r in rows]
    left = [0.0] * len(rows)
    for i, key in enumerate(STACK):
        values = [r[key] for r in rows]
        ax.barh(labels, values, left=left, color=f"C{i}", label=key.replace("_", " "))
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("share of the step (%)")
    ax.set_xlim(0, 100)
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    ax.set_title("Where a pipelined step's time goes (medians of traced steps)")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4], metavar="K")
    parser.add_argument("--micro-batches", type=int, default=8, metavar="M")
    parser.add_argument("--steps", type=int, default=6, help="clean traced steps wanted per configuration")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clean-threshold", type=float, default=0.1)
    parser.add_argument("--wait-quiet", type=float, default=20.0)
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="tiny models, K=2, 3 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.ks, args.steps, args.max_steps, args.warmup, args.wait_quiet = [2], 3, 3, 1, 0.0
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    sizes = SMOKE_SIZES if args.smoke else SIZES
    cores = len(os.sched_getaffinity(0))
    env = report.environment(threads_per_process=1, processes="one per stage (K), gloo on 127.0.0.1")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    models = {name: balances(name, sizes[name], args.ks, "time") for name in args.models}
    rows: list[dict] = []
    raw: dict[int, Any] = {}
    for K in args.ks:
        wait_quiet(args.wait_quiet, args.clean_threshold)
        job = {
            "M": args.micro_batches,
            "steps": args.steps,
            "max_steps": max(args.max_steps, args.steps),
            "warmup": args.warmup,
            "clean_threshold": args.clean_threshold,
            "wait_quiet": args.wait_quiet,
            "out_dir": args.out_dir,
            "models": {n: {"sizes": sizes[n], "balance": info["balance"][K]} for n, info in models.items()},
        }
        raw[K] = launch(run_job, K, job)
        for name in args.models:
            row = {"model": name, "K": K, "M": args.micro_batches, **summarize(raw[K][name]["steps"])}
            notes = ["oversubscribed"] if K > cores else []
            notes += ["noisy"] if row["clean"] < 3 else []
            row["note"] = ", ".join(notes)
            rows.append(
                {
                    k: 100 * v if k in (*SHARES, "bubble_of_pipeline", "theoretical_bubble") else v
                    for k, v in row.items()
                }
            )
            print(f"# {name} K={K}: {rows[-1]}", flush=True)
    total = time.perf_counter() - t_start
    command = report.command_line("overhead")
    md = ["# Where the time goes (GPipe Table 4), from the timeline", "", *report.environment_lines(env)]
    md += [
        f"- Command: `{command}`; total {total:.0f} s",
        "- Step: forward + loss + backward + RMSProp update, every stage traced; shares of the whole step (first "
        "event to last on any stage), medians over clean traced steps; checkpoint=except_last; balance by time.",
        "- bubble: time inside the pipeline (first forward to last backward) in which a stage computes nothing, "
        "averaged over stages (waiting for peers and the loss included); 'bubble % of pipeline' is the same over "
        "the pipeline's span only, beside GPipe's (K−1)/(M+K−1). load imbalance: (max − mean) of the stages' "
        "compute (a cause of bubble, not a share beside it). transfer: the part of the bubble spent in receive "
        "waits after the peer had sent. update: the optimizer step. other: the rest outside the pipeline's span "
        "(the loss, the benchmark's loop). The figure stacks the disjoint parts; its medians need not sum to 100.",
        f"- Rows with K > {cores} usable cores are oversubscribed (stages share cores).",
        "",
        *[f"- {name}: {info['model']}, balance {info['balance']}" for name, info in models.items()],
        "",
        report.markdown_table(rows, COLUMNS),
        "",
        *[f"![{r['model']} K={r['K']}](overhead_{r['model']}_k{r['K']}.png)" for r in rows],
    ]
    data = {"command": command, "environment": env, "models": models, "rows": rows, "raw": raw, "total_s": total}
    paths = report.write("overhead", data, "\n".join(md), figure(rows), out_dir=args.out_dir)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())} ({total:.0f} s)")


if __name__ == "__main__":
    main()
