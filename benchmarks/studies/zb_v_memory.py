"""ZB-V's peak activation against 1F1B's on the workload of issue 48's target: overhead.py's d = 512 Transformer."""

# K = 2 processes (gloo, one thread each), M = 8, the loss inside, the layers time-profiled and cut as overhead.py cuts
# them (1F1B: the shortest simulated GPipe step, one stage per rank; ZB-V: solve_virtual_stages(..., "zb-v"), two
# chunks per rank in a V). Per re-materialization mode (--checkpoint), one warm-up step, then each schedule's step
# measured once in the same processes: peak activation = the peak of the tensor storages allocated during the step
# (memory_probe's LiveTensors: activations, temporaries, received tensors, gradients in flight; not the model's
# state). Writes <out-dir>/zb_v_memory.{json,md}. From the repo root:
#   python -m benchmarks.studies.zb_v_memory --set d_model=512 H=2048 A=8

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import launch, steady_heap
from benchmarks._lib.memory_probe import Meter
from benchmarks._lib.workloads import SIZES, SMOKE_SIZES, balances, build, loss_fn, make_batch, per_micro_batch
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages

MB = 2**20


def run(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    steady_heap()
    sizes, M = job["sizes"], job["M"]
    x, target = make_batch("transformer", sizes)
    out: dict[str, Any] = {}
    for mode in job["checkpoints"]:
        stages = {
            "1f1b": GPipeStage(build("transformer", sizes), chunks=M, balance=job["balance"], checkpoint=mode),
            "zb-v": GPipeStage(
                build("transformer", sizes), chunks=M, balance=job["balance_v"], checkpoint=mode, virtual_stages=2,
                placement="v",
            ),
        }  # fmt: skip

        def step(schedule: str, stages: dict[str, GPipeStage] = stages) -> None:
            st = stages[schedule]
            per_micro = per_micro_batch(loss_fn, target, st.micro_batch_sizes(x))
            st.forward_backward(x if st.is_first else None, per_micro, schedule=schedule)  # type: ignore[arg-type]

        for schedule in stages:  # warm-up: the allocator's and autograd's first-use costs out of the window
            step(schedule)
        peaks = {}
        for schedule, st in stages.items():
            st.zero_grad(set_to_none=False)
            gc.collect()
            dist.barrier()
            meter = Meter(torch.device("cpu"))
            with meter.window():
                step(schedule)
            peaks[schedule] = meter.peak()
        out[mode] = peaks
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)  # launch returns rank 0's result: every rank's peaks in it
    return {"per_rank": gathered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro-batches", type=int, default=8, metavar="M")
    parser.add_argument("--checkpoint", nargs="+", default=["except_last", "never"])
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=INT", help="size changes, e.g. d_model=512")
    parser.add_argument("--out-dir", default=str(report.RESULTS / "schedules" / "zb_v"))
    parser.add_argument("--smoke", action="store_true", help="the tiny Transformer")
    args = parser.parse_args()
    base = SMOKE_SIZES if args.smoke else SIZES
    sizes = {**base["transformer"], **{k: int(v) for k, v in (kv.split("=") for kv in args.set)}}
    M, K = args.micro_batches, 2
    info = balances("transformer", sizes, [K], "time", M)
    costs = info["layer_costs_ms"]
    job = {
        "sizes": sizes,
        "M": M,
        "checkpoints": args.checkpoint,
        "balance": info["balance"][K],
        "balance_v": solve_virtual_stages(costs, K, 2, M, "except_last", "zb-v"),
    }
    per_rank = launch(run, K, job)["per_rank"]
    rows = []
    for mode in args.checkpoint:
        one = [r[mode]["1f1b"] for r in per_rank]
        v = [r[mode]["zb-v"] for r in per_rank]
        rows.append(
            {
                "checkpoint": mode,
                **{f"1f1b_{k}": b / MB for k, b in enumerate(one)},
                **{f"zbv_{k}": b / MB for k, b in enumerate(v)},
                "ratio": max(v) / max(one),
            }
        )
    env = report.environment(threads_per_process=1, processes="one per rank (gloo)")
    cols: list[report.Column] = [
        ("checkpoint", "re-materialization", ""),
        ("1f1b_0", "1F1B rank 0 MB", ".2f"),
        ("1f1b_1", "1F1B rank 1 MB", ".2f"),
        ("zbv_0", "ZB-V rank 0 MB", ".2f"),
        ("zbv_1", "ZB-V rank 1 MB", ".2f"),
        ("ratio", "worst rank, ZB-V / 1F1B", ".3f"),
    ]
    md = [f"# ZB-V's peak activation against 1F1B's (K = 2, M = {M}, the loss inside)", ""]
    md += [*report.environment_lines(env), f"- Command: `{report.command_line('studies.zb_v_memory')}`", ""]
    md += [f"- sizes: `{sizes}`; balance 1F1B {job['balance']}, ZB-V {job['balance_v']}", ""]
    md += [report.markdown_table(rows, cols)]
    command = report.command_line("studies.zb_v_memory")
    data = {"command": command, "environment": env, "sizes": sizes, "job": job, "per_rank": per_rank, "rows": rows}
    paths = report.write("zb_v_memory", data, "\n".join(md), out_dir=args.out_dir)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
