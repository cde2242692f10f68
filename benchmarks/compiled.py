"""Compiled layers against eager ones: a K = 2 pipeline's step with GPipeStage(compile=True) beside the same eager."""

# K = 2 processes (gloo, one thread each) build the benchmark Transformer (_lib/workloads.py; --set d_model=512 H=2048
# A=8 by default, the d = 512), or with --model amoebanet the benchmark AmoebaNet-D (its BatchNorm deferred
# inside the compiled cells), twice on the same split, eager and with every layer compiled (inductor), and
# time one training step of each (forward_backward with the loss per micro-batch on the last stage under --schedule,
# then RMSprop) by turns, medians of clean steps (machine.measure). The first step of each is timed apart, before: the
# compiled one's holds inductor's compilation (compile time ≈ its first step less the eager first step). Reports the
# compiled ÷ eager step, the compile time, and each compiled layer's graphs. Writes <out-dir>/compiled.{json,md}.
# From the repo root: python -m benchmarks.compiled

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import Runner, Timing, launch, measure, stats, wait_quiet
from benchmarks._lib.workloads import SIZES, SMOKE_SIZES, build, loss_fn, make_batch, per_micro_batch
from lightning_gpipe.pipe import GPipeStage

K = 2


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    sizes, model = job["sizes"], job["model"]
    x, target = make_batch(model, sizes)
    stages: dict[str, tuple[GPipeStage, torch.optim.Optimizer]] = {}
    for label, compile in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        stage = GPipeStage(build(model, sizes), chunks=job["M"], checkpoint=job["checkpoint"], compile=compile)
        stages[label] = (stage, torch.optim.RMSprop(stage.parameters(), lr=1e-4))

    def step(label: str) -> None:
        stage, optimizer = stages[label]
        loss = per_micro_batch(loss_fn, target, stage.micro_batch_sizes(x))
        stage.forward_backward(x if stage.is_first else None, loss, schedule=job["schedule"])
        optimizer.step()

    first = {}
    for label in stages:  # the compiled stage's first step compiles its layers
        stages[label][0].zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        step(label)
        dist.barrier()
        first[label] = time.perf_counter() - t0
    runners = {k: Runner(lambda s=stages[k][0]: s.zero_grad(set_to_none=True), lambda k=k: step(k)) for k in stages}
    timing = measure(runners, Timing(**job["timing"]))
    graphs: list[Any] = [None] * world
    dist.all_gather_object(graphs, stages["compiled"][0].compilations)
    return {
        "steps": {k: stats(r, sizes["batch"]) for k, r in timing.records.items()},
        "first_step_s": first,
        "graphs": {name: n for per_rank in graphs for name, n in per_rank.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["transformer", "amoebanet"], default="transformer")
    parser.add_argument("--set", nargs="*", default=None, metavar="KEY=VALUE", help="d_model=512 H=2048 A=8 by default")
    parser.add_argument("--M", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--steps", type=int, default=6, help="clean steps per system")
    parser.add_argument("--out-dir", default=str(report.RESULTS / "compiled"))
    parser.add_argument("--smoke", action="store_true", help="the tiny Transformer, 2 steps")
    args = parser.parse_args()
    sizes = dict(SMOKE_SIZES[args.model] if args.smoke else SIZES[args.model])
    if not args.smoke:
        given = args.set if args.set is not None or args.model != "transformer" else ["d_model=512", "H=2048", "A=8"]
        sizes.update({k: int(v) for k, v in (item.split("=") for item in given or [])})
    steps = 2 if args.smoke else args.steps
    timing = {"steps": steps, "max_steps": steps + 4, "warmup": 1, "clean_threshold": 0.1}
    timing["wait_quiet"] = 0.0 if args.smoke else 20.0
    job = {"model": args.model, "sizes": sizes, "M": args.M, "schedule": args.schedule, "timing": timing}
    job["checkpoint"] = args.checkpoint
    wait_quiet(timing["wait_quiet"], timing["clean_threshold"])
    result = launch(run_job, K, job)
    eager, compiled = result["steps"]["eager"], result["steps"]["compiled"]
    first = result["first_step_s"]
    row = {
        "workload": f"{args.model} " + ", ".join(f"{k}={v}" for k, v in sizes.items() if k != "vocab"),
        "schedule": f"{args.schedule} M={args.M} {args.checkpoint}",
        "eager_ms": eager["median_ms"],
        "compiled_ms": compiled["median_ms"],
        "speedup": eager["median_ms"] / compiled["median_ms"],
        "compile_s": first["compiled"] - first["eager"],
        "graphs": " ".join(f"{k}:{v}" for k, v in result["graphs"].items()),
    }
    print(f"  compiled ÷ eager step: {1 / row['speedup']:.3f} (speed-up {row['speedup']:.2f}×), "
          f"compile {row['compile_s']:.0f} s", flush=True)  # fmt: skip
    env = report.environment(threads_per_process=1, processes="K = 2, one per rank (gloo)")
    cols: list[report.Column] = [
        ("workload", "model", ""),
        ("schedule", "schedule", ""),
        ("eager_ms", "eager step ms", ".0f"),
        ("compiled_ms", "compiled step ms", ".0f"),
        ("speedup", "**eager ÷ compiled (target ≥ 1.1)**", ".3f"),
        ("compile_s", "compile time s (first step − eager's)", ".0f"),
        ("graphs", "graphs per compiled layer", ""),
    ]
    command = report.command_line("compiled")
    md = ["# GPipeStage(compile=True) against eager layers (K = 2, inductor)", "", *report.environment_lines(env)]
    md += [f"- Command: `{command}`", f"- {steps} clean steps each, by turns", "", report.markdown_table([row], cols)]
    data = {"command": command, "environment": env, "rows": [row], "raw": result}
    paths = report.write("compiled", data, "\n".join(md), out_dir=args.out_dir)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
