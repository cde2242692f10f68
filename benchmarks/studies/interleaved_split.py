"""Interleaving's split: the cheapest costliest virtual stage (``solve``) vs the shortest simulated step."""

# What it runs: the overhead benchmark's AmoebaNet-D and Transformer (_lib/workloads.py) at K = 2 (gloo on
# 127.0.0.1, one thread per process), interleaved-1f1b with v = 2 virtual stages per rank, M = 8, checkpoint
# "except_last", the loss per micro-batch on the last stage. Two stages of the same model, cut from the same per-layer
# times (profiled once, as balance="time" does): "per-chunk", solve(costs, 2K, 0.75), the split before
# solve_virtual_stages (each virtual stage as cheap as possible, the last one weighed × 0.75 as it does not
# recompute), and "simulated", virtual_stages.solve_virtual_stages (the split whose simulated interleaved step is
# shortest: each rank's virtual stages together). They alternate step by step in the same processes (forward +
# backward, no update); a step's ratio is taken against the other split's step of the same round, which cancels this
# VM's drift. Run from the repo root:
#   python -m benchmarks.studies.interleaved_split      (--smoke: tiny models, a few steps)
# Results: benchmarks/results/interleaved_split/README.md.

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch

from benchmarks._lib import report
from benchmarks._lib.machine import Timing, add_timing_args, launch, measure, paired_ratio, stats, wait_quiet, zeroed
from benchmarks._lib.workloads import SIZES, SMOKE_SIZES, balances, build, loss_fn, make_batch, per_micro_batch
from lightning_gpipe.pipe import GPipeStage, solve
from lightning_gpipe.pipe.split.virtual_stages import simulated_step, solve_virtual_stages

K, V, M = 2, 2, 8
SPLITS = ("per-chunk", "simulated")
COLS = (
    "model|model|; split|split|; balance|layers per chunk|; median_ms|median step ms|.1f; clean|clean/timed|; "
    "modelled|simulated step (cost units)|.1f; paired|step ÷ per-chunk's, paired by round|.3f"
)


def _step(stage: GPipeStage, x: Any, per_micro: Any) -> None:
    stage.forward_backward(x, per_micro, schedule="interleaved-1f1b")


def run_job(rank: int, world: int, job: dict) -> dict:
    out = {}
    for name, entry in job["models"].items():
        x, target = make_batch(name, entry["sizes"])
        runners = {}
        for split in SPLITS:
            torch.manual_seed(0)
            stage = GPipeStage(build(name, entry["sizes"]), chunks=M, balance=entry[split], virtual_stages=V)
            per_micro = per_micro_batch(loss_fn, target, stage.micro_batch_sizes(x))
            runners[split] = zeroed(stage, partial(_step, stage, x if stage.is_first else None, per_micro))
        out[name] = measure(runners, job["timing"]).records
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="tiny models, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    sizes = SMOKE_SIZES if args.smoke else SIZES
    env = report.environment(threads_per_process=1, processes="2 workers spawned by the script (gloo, 127.0.0.1)")
    models: dict[str, Any] = {}
    for name in args.models:
        costs = balances(name, sizes[name], [K], "time")["layer_costs_ms"]
        cut = {"per-chunk": solve(costs, V * K, 0.75), "simulated": solve_virtual_stages(costs, K, V, M, "except_last")}
        models[name] = {"sizes": sizes[name], "costs_ms": costs, **cut}
    waited = wait_quiet(args.wait_quiet, args.clean_threshold)
    raw = launch(run_job, K, {"models": models, "timing": timing})
    rows = []
    for name, entry in models.items():
        for split in SPLITS:
            st = stats(raw[name][split], 1)
            rows.append(
                {
                    "model": name,
                    "split": split,
                    "balance": str(entry[split]),
                    **st,
                    "clean": f"{st['clean_steps']}/{st['timed_steps']}",
                    "modelled": simulated_step(entry["costs_ms"], entry[split], K, V, M, "except_last"),
                    "paired": paired_ratio(raw[name][split], raw[name]["per-chunk"]),
                }
            )
    total = time.perf_counter() - t0
    md = "\n\n".join(
        [
            "# Interleaving's split: per chunk vs the shortest simulated step",
            "\n".join(
                [*report.environment_lines(env), f"- waited {waited:.0f} s for a quiet machine; total {total:.0f} s"]
            ),
            f"K = {K}, v = {V}, M = {M}, checkpoint except_last, the loss per micro-batch; forward + backward per "
            "step. Both splits from the same per-layer times (forward + backward of each layer alone on one "
            "micro-batch, as balance='time' measures them).",
            report.markdown_table(rows, report.columns(COLS)),
            f"Command: `{report.command_line('studies.interleaved_split')}`",
        ]
    )
    print(md)
    data: dict[str, Any] = dict(
        command=report.command_line("studies.interleaved_split"), environment=env, models=models
    )
    data.update(timing=vars(timing), rows=rows, raw=raw, total_s=total)
    paths = report.write("interleaved_split", data, md, out_dir=args.out_dir)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
