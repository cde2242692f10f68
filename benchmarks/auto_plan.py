"""schedule="auto" against a measured grid: the plan's choice beside the best schedule, M and re-materialization."""

# Per workload (_lib/workloads.py: AmoebaNet-D, the Transformer whose vocabulary projection is the backbone's last layer
# at d = 128 -- an LM whose layers are small -- and the same at d = 512), in this process on one thread: the plan's
# profile as GPipeStrategy measures it at setup (strategy/_auto_plan.measure_profile: each layer's forward + backward
# time on the batch and on an eighth of it, saved, output and weight bytes, the engine's time per action, the link
# between two processes), the plan (pipe/split/plan.plan) over the grid below, unconstrained and within a budget. Then K
# = 2 processes (gloo, one thread each) build a GPipeStage per grid point on its own split (the plan's, as
# schedule="auto" runs it) and time one training step each (forward_backward with the loss per micro-batch on the last
# stage, then RMSprop) by turns, medians of clean steps (machine.measure); the budget lies --budget-share of the way
# from the leanest candidate's predicted peak to the unconstrained choice's; the budgeted choice's peak (live tensors
# during a step + weights, gradients and optimizer state) measured once after. Reports, per workload: the best measured
# grid point, auto's choice and its measured step / the best's (target ≤ 1.03), the named schedules at the defaults (M =
# 8, except_last), and the budgeted choice's measured peak against the budget. The best of many noisy points is biased
# low (the winner's curse): the grid's FINALISTS fastest and auto's choice are then timed again by turns, --final-steps
# clean steps each, and that final round gives the verdict. Writes <out-dir>/auto_plan.{json,md}.
# From the repo root: python -m benchmarks.auto_plan

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import Runner, Timing, launch, measure, stats, wait_quiet
from benchmarks._lib.memory_probe import Meter
from benchmarks._lib.workloads import SIZES, SMOKE_SIZES, build, loss_fn, make_batch, per_micro_batch
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.schedule.registry import lookup
from lightning_gpipe.pipe.split.plan import Candidate, plan, predict
from lightning_gpipe.strategy._auto_plan import _measure_link, measure_profile

K = 2
WORKLOADS = {
    "amoebanet": ("amoebanet", {}),
    "lm-d128": ("transformer", {}),
    "transformer-d512": ("transformer", {"d_model": 512, "H": 2048, "A": 8}),
}
SCHEDULE_NAMES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zb-v"]
FINALISTS = 3  # the grid's fastest points timed again beside auto's choice


def key(c: Candidate) -> str:
    return f"{c.schedule} M={c.M} v={c.v} {c.checkpoint}"


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Every grid point's step, timed by turns; then the budgeted choice's peak memory."""
    name, sizes = job["model"], job["sizes"]
    x, target = make_batch(name, sizes)
    stages: dict[str, tuple[GPipeStage, torch.optim.Optimizer, str]] = {}
    for point in job["points"]:
        c = Candidate(**point["candidate"])
        torch.manual_seed(0)
        stage = GPipeStage(
            build(name, sizes), chunks=c.M, balance=point["balance"], checkpoint=c.checkpoint, virtual_stages=c.v,
            placement=lookup(c.schedule).placement,
        )  # fmt: skip
        stages[key(c)] = (stage, torch.optim.RMSprop(stage.parameters(), lr=1e-4), c.schedule)

    def step(k: str) -> None:
        stage, optimizer, schedule = stages[k]
        loss = per_micro_batch(loss_fn, target, stage.micro_batch_sizes(x))
        stage.forward_backward(x if stage.is_first else None, loss, schedule=schedule)  # type: ignore[arg-type]
        optimizer.step()

    runners = {k: Runner(lambda s=stages[k][0]: s.zero_grad(set_to_none=True), lambda k=k: step(k)) for k in stages}
    timing = measure(runners, Timing(**job["timing"]))
    out: dict[str, Any] = {"steps": {k: stats(r, sizes["batch"]) for k, r in timing.records.items()}}
    # Every rank ranks alike: each step's time is the max over the ranks (machine.timed).
    fastest = sorted(out["steps"], key=lambda k: out["steps"][k]["median_ms"])[:FINALISTS]
    finalists = list(dict.fromkeys([*fastest, *([job["auto"]] if job["auto"] in runners else [])]))
    final = measure({k: runners[k] for k in finalists}, Timing(**job["final_timing"]))
    out["final"] = {k: stats(r, sizes["batch"]) for k, r in final.records.items()}
    if job["budgeted"] is not None:
        stage, optimizer, _ = stages[job["budgeted"]]
        stage.zero_grad(set_to_none=False)
        gc.collect()
        dist.barrier()
        meter = Meter(torch.device("cpu"))
        with meter.window():
            step(job["budgeted"])
        state = [*stage.parameters(), *(p.grad for p in stage.parameters() if p.grad is not None)]
        state += [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        peak = [meter.peak() + sum(t.nbytes for t in state)]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, peak[0])
        out["budgeted_peak"] = gathered
    return out


def link_job(rank: int, world: int, job: Any) -> list[float]:
    """The link between the two processes, as GPipeStrategy measures it at setup."""
    assert dist.group.WORLD is not None
    return list(_measure_link(dist.group.WORLD, rank, torch.device("cpu")))


def grid_points(profile: Any, ms: list[int], checkpoints: list[str]) -> list[dict[str, Any]]:
    """Each grid point the registry admits, on the plan's split for it (as schedule="auto" would run it)."""
    points = []
    for schedule in SCHEDULE_NAMES:
        for v in (2,) if lookup(schedule).v_min > 1 else (1,):
            for M in ms:
                for mode in checkpoints:
                    c = Candidate(schedule, M, v, mode)  # type: ignore[arg-type]
                    try:
                        p = predict(profile, c, K)
                    except ValueError:
                        continue
                    points.append({"candidate": c.__dict__, "balance": p.balance, "predicted_s": p.step})
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16], metavar="M")
    parser.add_argument("--checkpoints", nargs="+", default=["except_last", "never"])
    parser.add_argument("--budget-share", type=float, default=0.5, help="0: the leanest's peak, 1: the choice's")
    parser.add_argument("--steps", type=int, default=3, help="clean steps per grid point")
    parser.add_argument("--final-steps", type=int, default=10, help="clean steps per point in the final round")
    parser.add_argument("--out-dir", default=str(report.RESULTS / "schedules" / "auto"))
    parser.add_argument("--smoke", action="store_true", help="the tiny LM, M = 2 and 4, one mode")
    args = parser.parse_args()
    if args.smoke:
        args.models = ["lm-d128"]
    torch.set_num_threads(1)  # the profile on one thread, as each worker runs
    base = SMOKE_SIZES if args.smoke else SIZES
    ms, checkpoints = ([2, 4], ["except_last"]) if args.smoke else (args.ms, args.checkpoints)
    checkpoints = list(checkpoints)  # Checkpoint names, checked by plan()
    timing = {"steps": args.steps, "max_steps": args.steps + 2, "warmup": 1, "clean_threshold": 0.1}
    timing["wait_quiet"] = 0.0 if args.smoke else 20.0
    final_steps = 2 if args.smoke else args.final_steps
    final_timing = {**timing, "steps": final_steps, "max_steps": final_steps + 4}
    rows, raw = [], {}
    link = tuple(launch(link_job, K, {}))
    for workload in args.models:
        name, changes = WORKLOADS[workload]
        sizes = {**base[name], **changes} if not args.smoke else dict(base[name])
        x, _ = make_batch(name, sizes)
        profile = measure_profile(build(name, sizes), x, sizes["batch"], torch.device("cpu"), link=link)
        ranked = plan(profile, K, Ms=ms, vs=(1, 2), checkpoints=checkpoints)
        leanest = min(max(p.peak_bytes) for p in ranked)  # the budget: between it and the unconstrained choice's peak
        budget = int(leanest + args.budget_share * (max(ranked[0].peak_bytes) - leanest))
        budgeted = plan(profile, K, budget, Ms=ms, vs=(1, 2), checkpoints=checkpoints)[0]
        points = grid_points(profile, ms, checkpoints)
        job: dict[str, Any] = {
            "model": name,
            "sizes": sizes,
            "points": points,
            "timing": timing,
            "final_timing": final_timing,
            "auto": key(ranked[0].candidate),
            "budgeted": key(budgeted.candidate),
        }
        if job["budgeted"] not in {key(Candidate(**p["candidate"])) for p in points}:
            job["budgeted"] = None
        wait_quiet(timing["wait_quiet"], timing["clean_threshold"])
        result = launch(run_job, K, job)
        measured = {k: v["median_ms"] for k, v in result["steps"].items()}
        final = {k: v["median_ms"] for k, v in result["final"].items()}
        best, final_best = min(measured, key=measured.__getitem__), min(final, key=final.__getitem__)
        chosen = key(ranked[0].candidate)
        defaults = {
            s: measured.get(key(Candidate(s, 8, 2 if lookup(s).v_min > 1 else 1, "except_last")))
            for s in SCHEDULE_NAMES
        }
        named = [v for v in defaults.values() if v is not None]
        row = {
            "workload": workload,
            "best": best,
            "best_ms": measured[best],
            "auto": chosen,
            "auto_ms": measured.get(chosen),
            "auto_vs_best": measured[chosen] / measured[best] if chosen in measured else None,
            "final_best": final_best,
            "auto_vs_final_best": final[chosen] / final[final_best] if chosen in final else None,
            "auto_vs_best_named": measured[chosen] / min(named) if chosen in measured and named else None,
            "predicted_ms": ranked[0].step * 1e3,
            "points": len(measured),
            "budget_mb": budget / 2**20,
            "budgeted": key(budgeted.candidate),
            "budgeted_peak_mb": max(result["budgeted_peak"]) / 2**20 if "budgeted_peak" in result else None,
        }
        rows.append(row)
        raw[workload] = {"sizes": sizes, "profile": profile.__dict__, "measured_ms": measured, "result": result}
        raw[workload]["ranked"] = [{"candidate": key(p.candidate), "step_ms": p.step * 1e3} for p in ranked[:10]]
        print(
            f"  {workload}: auto {chosen} {row['auto_vs_final_best']}× the final round's best ({final_best})",
            flush=True,
        )
    env = report.environment(threads_per_process=1, processes="K = 2, one per rank (gloo)")
    command = report.command_line("auto_plan")
    cols: list[report.Column] = [
        ("workload", "workload", ""),
        ("points", "grid points measured", ""),
        ("best", "best measured", ""),
        ("best_ms", "its step ms", ".0f"),
        ("auto", "auto's choice", ""),
        ("auto_ms", "its step ms", ".0f"),
        ("predicted_ms", "predicted ms", ".0f"),
        ("auto_vs_best", "auto / best, grid", ".3f"),
        ("final_best", "best of the final round", ""),
        ("auto_vs_final_best", "**auto / best, final round (target ≤ 1.03)**", ".3f"),
        ("auto_vs_best_named", "auto / best named at M = 8, except_last", ".3f"),
        ("budget_mb", "budget MB", ".1f"),
        ("budgeted", "choice within the budget", ""),
        ("budgeted_peak_mb", "its measured peak MB (worst rank)", ".1f"),
    ]
    md = ["# schedule='auto' against a measured grid (K = 2)", "", *report.environment_lines(env)]
    md += [
        f"- Command: `{command}`",
        f"- Grid: {SCHEDULE_NAMES} × M {ms} × {checkpoints}, {args.steps} clean steps each",
    ]
    md += [f"- Final round: the grid's {FINALISTS} fastest and auto's choice, {final_steps} clean steps each", ""]
    md += [report.markdown_table(rows, cols)]
    data = {"command": command, "environment": env, "rows": rows, "raw": raw}
    paths = report.write("auto_plan", data, "\n".join(md), out_dir=args.out_dir)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
