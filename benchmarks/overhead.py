"""GPipe paper Table 4 from the timeline: where a pipelined step's time goes, per loss path, for K = 2 and K = 4."""

# What it runs: throughput.py's small AmoebaNet-D and Transformer (_lib/workloads.py; the Transformer's vocabulary
# projection is the backbone's last layer), pipelined by GPipeStage over K processes (gloo on 127.0.0.1, 1 thread each,
# checkpoint="except_last" unless --checkpoint says otherwise, time-profiled balance cut as GPipeStrategy cuts it for
# "gpipe" with the loss inside, for the shortest simulated step: chunks.solve_virtual_stages), a training step = forward
# + loss + backward + RMSProp update, with the stage's timeline on, along seven loss paths, alternating step by step in
# the same processes: "whole-batch" (stage(x); the last stage's loss on the whole output; stage.backward()), and
# "gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb" and "zb-v" (stage.forward_backward: the loss per
# micro-batch on the last stage, inside the pipeline; the split backward halves, I and W, count as backward; interleaved
# on a stage of its own with v = 2 virtual stages per rank, the backbone cut in 2K chunks as GPipeStage cuts it:
# chunks.solve_virtual_stages; "zb-v" on a third, its two chunks per rank in a V, cut for it). Each step is traced on
# every stage (clocks lined up after a barrier), then broken down by lightning_gpipe.pipe.trace.stats.breakdown:
# recompute, bubble (pipeline time in which a stage computes nothing), load imbalance, transfer (the part of receive
# waits after the peer sent), the loss, the weight update, as shares of the step, and the efficiency (the ideal GPipe
# step over the measured one); medians over the clean traced steps. One Gantt chart per configuration. Writes
# <out-dir>/overhead.{json,md,png} and overhead_<model>_k<K>_<path>.png. Run from the repo root:
#   python -m benchmarks.overhead

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import launch, paired_interval, paired_ratio, pause_until_quiet, timed, wait_quiet
from benchmarks._lib.workloads import (
    SIZES,
    SMOKE_SIZES,
    balances,
    build,
    loss_fn,
    make_batch,
    per_micro_batch,
    resized,
)
from lightning_gpipe.pipe import GPipeStage, breakdown, gather_events
from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages
from lightning_gpipe.pipe.trace.events import Event
from lightning_gpipe.pipe.trace.gantt import plot_timeline

# The loss paths: today's (the loss on the whole output, between the forward and backward phases) and the
# schedules of GPipeStage.forward_backward (the loss per micro-batch on the last stage, inside the pipeline).
PATHS = ("whole-batch", "gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zb-v")


def stage_kind(path: str) -> str:
    """Which stage a loss path runs on: one chunk per rank, V interleaved chunks, or two chunks in a V (ZB-V's)."""
    return "v" if path == "zb-v" else "interleaved" if path.startswith("interleaved") else "one"


V = 2  # virtual stages per rank of the interleaved paths (their own stage: the backbone in vK parts)
# Disjoint shares of the whole step (first event to last on any stage, averaged over stages), in stacking order:
# compute, the loss, then the rest of the bubble split into waiting for a peer's compute and the transfer itself,
# then what lies outside the pipeline's span (the update, and the rest: the loop).
STACK = ("forward", "backward", "recompute", "loss", "waiting", "transfer", "update", "other")
# Table 4's columns: the bubble whole, and load imbalance -- a cause of part of the bubble, not a share beside it.
SHARES = ("forward", "backward", "recompute", "loss", "bubble", "transfer", "load_imbalance", "update", "other")


def traced_step(stage: GPipeStage, optimizer: torch.optim.Optimizer, x: Any, target: torch.Tensor, path: str) -> list:
    """One training step along ``path`` with the timeline on; every stage's events, lined up at the step's start (a
    collective). The whole-batch loss and its backward are recorded as a "loss" event (micro-batch -1) on the last
    stage, as the Lightning strategy records it; forward_backward records each micro-batch's loss itself."""
    timeline = stage.timeline
    timeline.clear()
    timeline.enabled = True
    origin = time.perf_counter_ns()  # just after timed()'s barrier: the same moment on every stage
    if path == "whole-batch":
        out = stage(x if stage.is_first else None)
        if stage.is_last:
            with timeline.record("loss"):
                loss_fn(out, target).backward()
        stage.backward()
    else:
        per_micro = per_micro_batch(loss_fn, target, stage.micro_batch_sizes(x))
        stage.forward_backward(x if stage.is_first else None, per_micro, schedule=path)
    start = time.perf_counter_ns()
    optimizer.step()
    timeline.events.append(Event("update", stage.index, -1, start, time.perf_counter_ns()))
    timeline.enabled = False
    return gather_events(timeline, origin_ns=origin)


def step_shares(events: list, placement: str = "loop") -> dict[str, float]:
    b = breakdown(events, placement)
    span, p_span = b["span_ms"], b["pipeline_span_ms"]
    shares = {kind: b["shares"][kind] for kind in ("forward", "backward", "recompute", "loss", "transfer", "update")}
    shares["backward"] += b["shares"]["backward-input"] + b["shares"]["backward-weight"]  # zb-h1's halves
    # The bubble and the imbalance are fractions of the pipeline's span; here, shares of the whole step.
    bubble = b["bubble"] * p_span / span
    # The whole batch's loss (micro-batch -1) lies between the phases, inside the bubble; a micro-batch's is compute.
    whole_loss = sum(e.end_ns - e.start_ns for e in events if e.kind == "loss" and e.micro_batch < 0)
    return {
        "span_ms": span,
        **shares,
        "bubble": bubble,
        "waiting": bubble - shares["transfer"] - whole_loss / 1e6 / span / b["K"],
        "other": (span - p_span) / span - shares["update"],
        "load_imbalance": b["load_imbalance"] * p_span / span,
        "bubble_of_pipeline": b["bubble"],
        "theoretical_bubble": b["theoretical_bubble"],
        "efficiency": b["efficiency"],
    }


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One K (= world): every model, the loss paths by turns (the order flips every round) in the same processes,
    until each has ``steps`` clean traced steps (at most ``max_steps``)."""
    out: dict[str, Any] = {}
    paths = job["paths"]
    for name, entry in job["models"].items():
        stages, optimizers = {}, {}
        for path in paths:
            kind = stage_kind(path)
            if kind not in stages:
                torch.manual_seed(0)
                balance = {
                    "one": entry["balance"],
                    "interleaved": entry["balance_interleaved"],
                    "v": entry["balance_v"],
                }
                stages[kind] = GPipeStage(
                    build(name, entry["sizes"]),
                    chunks=job["M"],
                    balance=balance[kind],
                    checkpoint=job["checkpoint"],
                    virtual_stages=1 if kind == "one" else V,
                    placement="v" if kind == "v" else "loop",
                )
                optimizers[kind] = torch.optim.RMSprop(stages[kind].parameters(), lr=1e-4)
        x, target = make_batch(name, entry["sizes"])
        steps: dict[str, list[dict]] = {path: [] for path in paths}
        charts: dict[str, list | None] = {path: None for path in paths}
        for s in range(job["warmup"] + job["max_steps"]):
            disturbed = False
            for path in paths if s % 2 == 0 else paths[::-1]:
                stage, optimizer = stages[stage_kind(path)], optimizers[stage_kind(path)]
                stage.zero_grad(set_to_none=True)
                rec, events = timed(lambda p=path, st=stage, o=optimizer: traced_step(st, o, x, target, p))  # noqa: B023
                clean = rec["foreign_cores"] < job["clean_threshold"]
                disturbed |= not clean
                if s >= job["warmup"] and rank == 0:
                    shares = step_shares(events, stage.placement)
                    row = {**shares, "clean": clean, "foreign_cores": rec["foreign_cores"]}
                    row["page_faults"] = rec["page_faults"]
                    steps[path].append(row)
                    charts[path] = events if clean or charts[path] is None else charts[path]
            wanted = min(sum(st["clean"] for st in steps[path]) for path in paths) >= job["steps"]
            done = torch.tensor([wanted], dtype=torch.float64)
            dist.broadcast(done, src=0)
            if done.item():
                break
            if disturbed and job["wait_quiet"] > 0:
                pause_until_quiet(job["wait_quiet"], job["clean_threshold"])
        if rank == 0:
            out[name] = {}
            for path in paths:
                png = Path(job["out_dir"]) / f"overhead_{name}_k{world}_{path}.png"
                events = [dataclasses.asdict(e) for e in charts[path]]
                out[name][path] = {"steps": steps[path], "gantt": str(png), "gantt_events": events}
    return out


def summarize(steps: list[dict]) -> dict[str, Any]:
    clean = [s for s in steps if s["clean"]]
    use = clean if len(clean) >= 3 else steps
    keys = (*SHARES, "waiting", "span_ms", "bubble_of_pipeline", "efficiency", "page_faults")
    row = {key: statistics.median(s.get(key, math.nan) for s in use) for key in keys}  # older files: no faults
    return {**row, "theoretical_bubble": steps[0]["theoretical_bubble"], "n": len(use), "clean": len(clean)}


COLUMNS: list[report.Column] = [
    ("model", "model", ""),
    ("K", "K", ""),
    ("M", "M", ""),
    ("path", "loss path", ""),
    ("span_ms", "step ms", ".0f"),
    ("vs_whole", "step / whole-batch's", ".2f"),
    ("vs_gpipe_paired", "step / gpipe's, paired by round", ".3f"),
    ("vs_gpipe_ci", "its 95 % interval", ""),
    ("efficiency", "efficiency (ideal GPipe step / step)", ".2f"),
    *[(key, f"{key.replace('_', ' ')} %", ".1f") for key in SHARES],
    ("bubble_of_pipeline", "bubble % of pipeline", ".1f"),
    ("theoretical_bubble", "(K−1)/(M+K−1) %", ".1f"),
    ("page_faults", "page faults a step (rank max)", ".0f"),
    ("n", "steps", ""),
    ("note", "note", ""),
]


def _entries(data: dict) -> list[tuple[dict, dict]]:
    """Each row of a results file with its raw entry (``steps``, ``gantt``...; older files: one path per model)."""
    out = []
    for r in data["rows"]:
        entry = data["raw"][str(r["K"])][r["model"]]
        out.append((r, entry if "steps" in entry else entry[r["path"]]))
    return out


def stacked_shares(data: dict) -> list[tuple[str, dict[str, float]]]:
    """Per row of a results file: its label and the disjoint shares of the step it stacks (``STACK``), in %.

    Each share is 100 × the median of the raw steps' fractions (the clean steps, as ``summarize`` picks them), so
    every part is in the same unit whatever the row's stored columns are (older files stored ``waiting`` as a
    fraction beside percentages).
    """
    out = []
    for r, entry in _entries(data):
        steps = entry["steps"]
        clean = [s for s in steps if s["clean"]]
        use = clean if len(clean) >= 3 else steps
        shares = {key: 100 * statistics.median(s[key] for s in use) for key in STACK if key in steps[0]}
        label = f"{r['model']} K={r['K']}" + (f" {r['path']}" if "path" in r else "")
        label += f" (eff. {r['efficiency']:.2f})" if r.get("efficiency") is not None else ""
        label += ", oversubscribed" if "oversubscribed" in (r.get("note") or "") else ""
        out.append((label, shares))
    return out


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded): per configuration, the step's time as stacked shares (%)."""
    bars = stacked_shares(data)
    fig, axes = report.subplots(figsize=(11, 1.9 + 0.42 * len(bars)))
    ax = axes[0][0]
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for i, key in enumerate(STACK):
        if not any(key in shares for _, shares in bars):
            continue
        values = [shares.get(key, 0.0) for _, shares in bars]
        ax.barh(labels, values, left=left, color=f"C{i}", label=key.replace("_", " "))
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlim(0, max([100.0, *left]))  # medians of disjoint parts: their sum may pass 100 a little
    rows = data["rows"]
    ylabel = "model, K (stages)" + (", loss path" if any("path" in r for r in rows) else "")
    ylabel += " (efficiency)" if any(r.get("efficiency") is not None for r in rows) else ""
    ax.set(xlabel="share of the step (%)", ylabel=ylabel)
    report.legend_right(ax, title="part of the step")
    M = rows[0]["M"] if rows else "?"
    what = f"Where a pipelined step's time goes (GPipe Table 4): medians of traced steps, M = {M}"
    return report.title(fig, what, data["environment"])


def replot_extra(data: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Each configuration's Gantt chart, from the traced step the results file keeps (none in older files)."""
    written = []
    machine = report.machine_label(data["environment"])
    for r, entry in _entries(data):
        if not entry.get("gantt_events"):
            continue
        png = Path(out_dir) / Path(entry["gantt"]).name
        events = [Event(**e) for e in entry["gantt_events"]]
        path = f", loss: {r['path']}" if "path" in r else ""
        plot_timeline(events, png, title=f"{r['model']}{path}; {machine}")
        written.append(png)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4], metavar="K")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS), help="loss paths compared")
    parser.add_argument("--micro-batches", type=int, default=8, metavar="M")
    parser.add_argument("--steps", type=int, default=6, help="clean traced steps wanted per configuration")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clean-threshold", type=float, default=0.1)
    parser.add_argument("--wait-quiet", type=float, default=20.0)
    parser.add_argument("--checkpoint", choices=["except_last", "always", "never"], default="except_last")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="tiny models, K=2, 3 steps, no quiet waits")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=INT", help="size changes, e.g. d_model=256")
    args = parser.parse_args()
    if args.smoke:
        args.ks, args.steps, args.max_steps, args.warmup, args.wait_quiet = [2], 3, 3, 1, 0.0
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    sizes = resized(SMOKE_SIZES if args.smoke else SIZES, args.set)
    cores = len(os.sched_getaffinity(0))
    env = report.environment(threads_per_process=1, processes="one per stage (K), gloo on 127.0.0.1")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    # One cut for the one-chunk paths: as GPipeStrategy cuts for "gpipe" with the loss inside.
    models = {name: balances(name, sizes[name], args.ks, "time", args.micro_batches) for name in args.models}
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
            "models": {
                n: {
                    "sizes": sizes[n],
                    "balance": info["balance"][K],
                    # As GPipeStage(virtual_stages=V) splits measured costs: for the simulated interleaved step.
                    "balance_interleaved": solve_virtual_stages(
                        info["layer_costs_ms"], K, V, args.micro_batches, args.checkpoint
                    ),
                    "balance_v": solve_virtual_stages(
                        info["layer_costs_ms"], K, 2, args.micro_batches, args.checkpoint, "zb-v"
                    ),
                }
                for n, info in models.items()
            },
            "paths": args.paths,
            "checkpoint": args.checkpoint,
        }
        raw[K] = launch(run_job, K, job)
        for name in args.models:
            for path in args.paths:
                row = {"model": name, "K": K, "M": args.micro_batches, "path": path}
                row |= summarize(raw[K][name][path]["steps"])
                notes = ["oversubscribed"] if K > cores else []
                notes += ["noisy"] if row["clean"] < 3 else []
                row["note"] = ", ".join(notes)
                percent = (*STACK, *SHARES, "bubble_of_pipeline", "theoretical_bubble")
                rows.append({k: 100 * v if k in percent else v for k, v in row.items()})
                print(f"# {name} K={K} {path}: {rows[-1]}", flush=True)
    for r in rows:
        whole = [w for w in rows if (w["model"], w["K"], w["path"]) == (r["model"], r["K"], "whole-batch")]
        r["vs_whole"] = r["span_ms"] / whole[0]["span_ms"] if whole else None
        if "gpipe" in args.paths:
            entry = raw[r["K"]][r["model"]]
            pair = (entry[r["path"]]["steps"], entry["gpipe"]["steps"], "span_ms")
            r["vs_gpipe_paired"] = paired_ratio(*pair)
            interval = paired_interval(*pair) if r["path"] != "gpipe" else None
            r["vs_gpipe_ci"] = f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else ""
    total = time.perf_counter() - t_start
    command = report.command_line("overhead")
    md = ["# Where the time goes (GPipe Table 4), from the timeline", "", *report.environment_lines(env)]
    md += [
        f"- Command: `{command}`; total {total:.0f} s",
        "- Step: forward + loss + backward + RMSProp update, every stage traced; shares of the whole step (first "
        f"event to last on any stage), medians over clean traced steps; checkpoint={args.checkpoint}; balance by "
        "time. "
        "Loss paths, alternating step by step in the same processes: whole-batch = `stage(x)`, the loss on the "
        "whole output on the last stage and its backward, `stage.backward()`; gpipe / 1f1b / zb-h1 = "
        "`stage.forward_backward(x, loss_fn, schedule=...)`, the loss per micro-batch (weighted n_m/N) on the last "
        "stage.",
        "- efficiency: the ideal GPipe step (all the step's compute, the loss and the update, spread evenly over K "
        "stages and stretched by (M+K−1)/M) over the measured step (`lightning_gpipe.pipe.breakdown`).",
        "- bubble: time inside the pipeline (first forward to last backward) in which a stage computes nothing, "
        "averaged over stages (waiting for peers and the loss included); 'bubble % of pipeline' is the same over "
        "the pipeline's span only, beside GPipe's (K−1)/(M+K−1). load imbalance: (max − mean) of the stages' "
        "compute (a cause of bubble, not a share beside it). transfer: the part of the bubble spent in receive "
        "waits after the peer had sent. loss: the loss (whole-batch: with its backward to the output, between the "
        "phases, inside the bubble). backward: zb-h1's I and W included. update: the optimizer step. other: the "
        "rest outside the pipeline's span (the benchmark's loop). The figure stacks the disjoint parts; its medians "
        "need not sum to 100.",
        f"- Rows with K > {cores} usable cores are oversubscribed (stages share cores).",
        "",
        *[f"- {name}: {info['model']}, balance {info['balance']}" for name, info in models.items()],
        "",
        report.markdown_table(rows, COLUMNS),
        "",
        *[f"![{r['model']} K={r['K']} {r['path']}](overhead_{r['model']}_k{r['K']}_{r['path']}.png)" for r in rows],
    ]
    data = {"command": command, "environment": env, "models": models, "rows": rows, "raw": raw, "total_s": total}
    paths = report.write("overhead", data, "\n".join(md), out_dir=args.out_dir, plot=plot)
    replot_extra(json.loads(Path(paths["json"]).read_text()), args.out_dir)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())} ({total:.0f} s)")


if __name__ == "__main__":
    main()
