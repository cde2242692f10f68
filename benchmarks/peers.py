"""Ours vs torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B vs a plain process, fixed and varied length."""

# Run it from the repo root: python -m benchmarks.peers (--smoke: a small model, about half a minute).

from __future__ import annotations

import argparse
import copy
import os
import time
from typing import Any

import torch.distributed as dist
from torch import nn

from benchmarks._lib import report
from benchmarks._lib import workloads as wl
from benchmarks._lib.machine import (
    Timing,
    add_timing_args,
    background_load,
    cpu_snapshot,
    launch,
    max_over_ranks,
    measure,
    probe,
    stats,
    wait_quiet,
    zeroed,
)
from benchmarks._lib.peers_variable import (  # variable lengths, and the probes of torch's schedule built once
    REL_TOL,
    VAR_SYSTEMS,
    collect_probes,
    plot_peers,
    start_probes,
    variable_lengths,
    variable_summary,
)
from lightning_gpipe.pipe import GPipeStage

# The encoder stack's sizes (workloads' module globals, studies/engine_speed.py's), and a small one for --smoke.
FULL = {k: getattr(wl, k) for k in ("LAYERS", "D_MODEL", "HEADS", "FFN", "BATCH", "SEQ")}
SMOKE = wl.SMOKE_ENCODER
LENGTHS, SMOKE_LENGTHS = [16, 32, 24, 40, 8, 48, 32, 16, 56, 24], [8, 16, 4, 12]
# ours except_last / always: the whole-batch loss path (stage(x), the loss on the last stage, stage.backward()).
# ours gpipe / 1f1b: stage.forward_backward, the loss per micro-batch on the last stage, as torch's schedules do; with
# checkpoint="always" every micro-batch is recomputed on every stage, the same re-materialization as torch's stages
# (one torch.utils.checkpoint per stage); "(except_last)": ours' default, where a micro-batch whose backward follows
# its forward keeps its graph (every one on the last stage).
TRAIN = {  # system: (schedule, checkpoint) of ours via forward_backward
    "ours gpipe": ("gpipe", "always"),
    "ours 1f1b": ("1f1b", "always"),
    "ours gpipe (except_last)": ("gpipe", "except_last"),
    "ours 1f1b (except_last)": ("1f1b", "except_last"),
}
SYSTEMS = ("ours except_last", "ours always", *TRAIN, "torch GPipe", "torch 1F1B", "plain")
RATIOS = {  # ratio of throughputs: (numerator system, denominator system)
    "gpipe_torch": ("ours gpipe", "torch GPipe"),
    "1f1b_torch": ("ours 1f1b", "torch 1F1B"),
    "gpipe_el_torch": ("ours gpipe (except_last)", "torch GPipe"),
    "1f1b_el_torch": ("ours 1f1b (except_last)", "torch 1F1B"),
    "ours_torch": ("ours except_last", "torch GPipe"),
    "always_torch": ("ours always", "torch GPipe"),
    "ours_plain": ("ours 1f1b (except_last)", "plain"),
    "torch_plain": ("torch 1F1B", "plain"),
}
FIXED_COLS = (
    "system|system|; M|M|; median_ms|median ms|.1f; min_ms|min|.1f; max_ms|max|.1f; samples_per_s|samples/s|.1f; "
    "clean|clean/timed|; over_plain|speed-up over plain|.2f"
)
RATIO_COLS = (
    "M|M|; gpipe_torch|**ours gpipe / torch GPipe** (same remat.)|.2f; 1f1b_torch|**ours 1f1b / torch 1F1B** (same "
    "remat.)|.2f; gpipe_el_torch|ours gpipe (except_last) / torch GPipe|.2f; 1f1b_el_torch|ours 1f1b (except_last) / "
    "torch 1F1B|.2f; ours_torch|ours whole-batch except_last / torch GPipe|.2f; always_torch|ours whole-batch always / "
    "torch GPipe|.2f; ours_plain|ours 1f1b (except_last) / plain|.2f; torch_plain|torch 1F1B / plain|.2f; "
    "ideal|ideal 2M/(M+1)|.2f"
)
VAR_COLS = (
    "system|system|; steps|clean/timed steps|; tokens_per_s|tokens/s|.0f; us_per_token|µs/token|.1f; "
    "vs_plain|vs plain|.2f; max_rel_diff|max rel. loss diff vs plain|.1e; match|≤ {tol:g}|"
)
STEP_COLS = "step|step|; L|length|; " + "; ".join(f"{n}|{n} ms|.1f" for n in VAR_SYSTEMS)
STEP_COLS += "; loss|plain loss|.6f; diff|ours rel. diff|.1e"


# ------------------------------------------------------------------------------------ the main job (2 processes)
def run_job(rank: int, world: int, job: dict) -> dict:
    wl.configure(job["shape"])
    model, (x, y) = wl.build_encoder(), wl.encoder_batch()
    last, half = rank == 1, wl.LAYERS // 2
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, probe())
    # Reference gradients of this rank's layers: the whole model on the whole batch, computed once.
    ref = copy.deepcopy(model)
    wl.plain_step(ref, x, y)
    ref_grads = [p.grad for p in nn.Sequential(*list(ref)[rank * half : (rank + 1) * half]).parameters()]
    plain = copy.deepcopy(model)  # runs on the last rank only; rank 0 waits in the step's closing barrier
    out: dict[str, Any] = {"probe_gflops": gathered, "fixed": {}}
    for M in job["micro_batches"]:
        groups = {name: dist.new_group([0, 1]) for name in SYSTEMS if name != "plain"}  # a group per pipeline

        def ours(name: str, mode: str, M: int = M, groups: dict = groups) -> GPipeStage:
            return GPipeStage(copy.deepcopy(model), chunks=M, balance=[half, half], checkpoint=mode, group=groups[name])

        stages = {n: ours(n, n.split()[1]) for n in ("ours except_last", "ours always")}
        stages |= {name: ours(name, mode) for name, (_, mode) in TRAIN.items()}
        modules: dict[str, nn.Module] = dict(stages)
        runners = {n: zeroed(stages[n], lambda s=stages[n]: wl.ours_step(s, x, y)) for n in stages if n not in TRAIN}
        for name, (sched, _) in TRAIN.items():
            runners[name] = zeroed(stages[name], lambda s=stages[name], k=sched: wl.ours_forward_backward(s, x, y, k))
        for name, sched in (("torch GPipe", "gpipe"), ("torch 1F1B", "1f1b")):
            schedule, modules[name] = wl.build_torch(model, rank, M, groups[name], "stage", sched)
            runners[name] = zeroed(modules[name], lambda s=schedule: wl.torch_step(s, last, x, y))
        runners["plain"] = zeroed(plain, lambda: wl.plain_step(plain, x, y) if last else None)
        grad_diff: dict[str, float] = {}

        def compare(modules: dict = modules, grad_diff: dict = grad_diff) -> None:
            for name, mod in modules.items():
                d = max((g - r).abs().max().item() for g, r in zip(wl.grads(mod), ref_grads))
                grad_diff[name] = max_over_ranks(d)

        m = measure(runners, job["timing"], after_first=compare)
        out["fixed"][str(M)] = dict(records=m.records, first_loss=m.first, grad_diff=grad_diff, paused_s=m.paused_s)
    out["variable"] = variable_lengths(rank, model, job)
    return out


# ------------------------------------------------------------------------------------------------------- driver
def parse_args() -> tuple[argparse.Namespace, Timing]:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], metavar="M")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="sequence length of each step")
    parser.add_argument("--var-passes", type=int, default=2, help="timed passes over --lengths (after 1 warm-up step)")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="small model, M=4, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.micro_batches, args.lengths, args.var_passes = [4], SMOKE_LENGTHS, 1
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    if not all(1 <= m <= (SMOKE if args.smoke else FULL)["BATCH"] for m in args.micro_batches):
        parser.error("M must be in 1..batch size")
    return args, Timing.from_args(parser, args)


def tabulate(raw: dict, micro_batches: list[int]) -> tuple[list[dict], list[dict]]:
    """Per system and M: step statistics, speed-up over plain, first-step sanity; per M: the side-by-side ratios."""
    rows, ratios = [], []
    for M in micro_batches:
        entry = raw["fixed"][str(M)]
        st = {name: stats(entry["records"][name], wl.BATCH) for name in SYSTEMS}
        med = {name: st[name]["median_ms"] for name in SYSTEMS}
        for name in SYSTEMS:
            clean, grad = f"{st[name]['clean_steps']}/{st[name]['timed_steps']}", entry["grad_diff"]
            rows.append({"system": name, "M": M, **st[name], "clean": clean, "over_plain": med["plain"] / med[name]})
            rows[-1].update(first_loss=entry["first_loss"][name], grad_diff=grad.get(name, 0.0))
        ratios.append({"M": M, "ideal": 2 * M / (M + 1), **{k: med[b] / med[a] for k, (a, b) in RATIOS.items()}})
    return rows, ratios


def plot(data: dict) -> Any:
    """The figure of a results file (see ``peers_variable.plot_peers``)."""
    shape = data["job"]["shape"]
    what = (
        f"Ours vs torch.distributed.pipelining, K = 2: {shape['LAYERS']} Transformer encoder layers "
        f"(d {shape['D_MODEL']}), MSE loss"
    )
    fixed = f"fixed shape, batch {shape['BATCH']} × {shape['SEQ']} tokens"
    return plot_peers(data, fixed, "torch GPipe\nbuilt once", what)


def markdown(env: dict, args: argparse.Namespace, raw: dict, tables: tuple, probes: dict, extra: str) -> str:
    rows, ratios, var_rows = tables
    per_step = [{"step": s["step"], "L": s["L"], **{n: s[n]["ms"] for n in VAR_SYSTEMS}} for s in raw["variable"]]
    for rec, s in zip(per_step, raw["variable"]):
        rec.update(loss=s["plain"]["loss"], diff=s["ours except_last"]["rel_diff_vs_plain"])
    sanity = "; ".join(f"M={r['M']} {r['system']} {r['first_loss']:.6f} ({r['grad_diff']:.1e})" for r in rows)
    model = (
        f"Model: {wl.LAYERS} × TransformerEncoderLayer(d={wl.D_MODEL}, heads={wl.HEADS}, ffn={wl.FFN}, dropout 0), "
        f"MSE loss; K=2 stages of {wl.LAYERS // 2} layers. torch's stage runs its layers under one "
        "`torch.utils.checkpoint` (every micro-batch recomputed), its schedules computing the loss per micro-batch "
        "on the last stage. Ours: `except_last` / `always` = the whole-batch loss path (`stage(x)`, the loss on the "
        "whole output, `stage.backward()`; `except_last` keeps the last micro-batch's graph, `always` recomputes "
        "all); `gpipe` / `1f1b` = `stage.forward_backward(x, loss_fn, schedule=...)`, the loss per micro-batch on the "
        'last stage like torch\'s, with `checkpoint="always"` (every micro-batch recomputed on every stage: the same '
        "re-materialization as torch's) or, marked `(except_last)`, ours' default (a micro-batch whose backward "
        "comes right after its forward keeps its graph: every one on the last stage). `plain` = the whole model on "
        "the whole batch in one process (rank 1, while rank 0 waits), no recomputation. All alternate step by step "
        "in the same two processes; a step = forward + loss + backward between barriers; medians of clean steps "
        f"after {args.warmup} warm-up."
    )
    var = f"{args.lengths} × {args.var_passes} pass(es), batch {wl.BATCH}, M={args.micro_batches[0]}"
    probe_lines = []
    for name, p in probes.items():
        probe_lines.append(f"- **{name}** {p['lengths']}: {p['verdict']}")
        for r in p["ranks"]:
            steps = ", ".join(f"L={s['L']} " + (f"`{s['error']}`" if "error" in s else "ok") for s in r["steps"])
            probe_lines.append(
                f"  - rank {r['rank']}: {r['exit']}; steps {steps}" + f"; `{r['abort']}`" * bool(r["abort"])
            )
    blocks = [
        "# Peers: ours vs torch.distributed.pipelining ScheduleGPipe and Schedule1F1B vs plain",
        "\n".join([*report.environment_lines(env), extra]),
        model,
        f"## Fixed shape (batch {wl.BATCH} × {wl.SEQ})",
        report.markdown_table(rows, report.columns(FIXED_COLS)),
        report.markdown_table(ratios, report.columns(RATIO_COLS)),
        f"First-step loss (max abs. gradient difference from plain's), same weights and batch: {sanity}",
        f"## Variable sequence length: {var}",
        "`torch GPipe rebuilt per step`: a new torch `GPipeStage` + `ScheduleGPipe` around the same stage module "
        "every step; its time includes the build and torch's runtime shape inference. `ours 1f1b (except_last)`: "
        '`stage.forward_backward(..., schedule="1f1b")`, the loss per micro-batch. Step -1 is the warm-up.',
        report.markdown_table(var_rows, report.columns(VAR_COLS.format(tol=REL_TOL))),
        report.markdown_table(per_step, report.columns(STEP_COLS)),
        "### torch's ScheduleGPipe built once (first length), then fed the next lengths",
        "\n".join(probe_lines),
        f"Command: `{report.command_line('peers')}`",
    ]
    return "\n\n".join(blocks)


def main() -> None:
    args, timing = parse_args()
    shape = SMOKE if args.smoke else FULL
    wl.configure(shape)
    M0, t_start = args.micro_batches[0], time.perf_counter()
    how = "2 workers spawned by the script (gloo, 127.0.0.1), plain on rank 1 while rank 0 waits; 2 processes forked"
    env = report.environment(threads_per_process=1, processes=how + " per probe of torch's schedule built once")
    job = dict(shape=shape, timing=timing, micro_batches=args.micro_batches, var_m=M0, lengths=args.lengths)
    job["var_passes"] = args.var_passes
    print(f"# {env['cpu_model']}, torch {env['torch']}; {shape}; M={args.micro_batches}", flush=True)
    probe_lengths = {"the run's lengths": args.lengths}
    if min(args.lengths) < args.lengths[0] and not args.smoke:
        probe_lengths["first change shrinks"] = [args.lengths[0], min(args.lengths)]
    pg_timeout, limit = (10.0, 60.0) if args.smoke else (30.0, 90.0)
    # --smoke runs the probe (untimed) alongside the main job, to be quick; a measured run, after it.
    handle = start_probes(probe_lengths, shape, M0, pg_timeout) if args.smoke else None
    waited = wait_quiet(args.wait_quiet, args.clean_threshold)
    load_before, snap = os.getloadavg(), cpu_snapshot()
    raw = launch(run_job, 2, job)
    background, background_line = background_load(snap, load_before)
    print(f"# main job done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    probes = collect_probes(handle or start_probes(probe_lengths, shape, M0, pg_timeout), limit)
    rows, ratios = tabulate(raw, args.micro_batches)
    var_rows = variable_summary(raw["variable"])
    total, gf = time.perf_counter() - t_start, raw["probe_gflops"]
    extra = (
        f"- Machine check: both ranks at once {gf[0]:.0f} and {gf[1]:.0f} GFLOP/s (1-thread 512² matmul); waited "
        f"{waited:.0f} s for a quiet machine; {background_line.lstrip('# ')}; total {total:.0f} s"
    )
    md = markdown(env, args, raw, (rows, ratios, var_rows), probes, extra)
    print(md)
    data = dict(command=report.command_line("peers"), environment=env, job={**job, "timing": vars(timing)})
    data.update(machine_check={"probe_gflops": gf, **background}, fixed=rows, ratios=ratios, variable=var_rows)
    data.update(variable_steps=raw["variable"], torch_built_once=probes, raw_fixed=raw["fixed"], total_s=total)
    paths = report.write("peers", data, md, out_dir=args.out_dir, plot=plot)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
