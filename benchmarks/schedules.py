"""The simulator as a cost model: each schedule's step predicted from per-layer costs, checked against measured ones."""

# What it does, per model (throughput.py's small AmoebaNet-D and Transformer, _lib/workloads.py):
# 1. Costs on this machine, in this process (1 thread): each layer's forward (without grad, kept under grad, and
#    recomputed), backward, zb-h1's split halves, RMSprop update and output bytes, on one micro-batch; the loss; the
#    one-process engine factor, from the whole model's one-stage pipeline (_lib/costmodel.py says how each enters).
# 2. Validation: for K in --ks, K processes (gloo on 127.0.0.1, 1 thread each, the balance solved on the costs as
#    GPipeStage solves them, interleaved chunks by chunks.solve_virtual_stages; the
#    K=2 launch first fits gloo's latency and bandwidth by ping-pongs, and a message's host time on each end through
#    the transport): a training step (stage.forward_backward with
#    the loss per micro-batch on the last stage, then RMSprop) for every schedule the executor runs
#    (pipe.schedule.registry), and by turns with them each rank's one-stage pipelines of its stages, co-run and
#    alone (the per-stage engine factors, _lib/costmodel_ranks.py), medians of clean steps; then five traced steps per
#    schedule, whose time per rank and kind of work (medians) is set beside the simulator's (where the two part).
#    Predicted vs measured, for K > usable cores as well (labelled oversubscribed; there the prediction also bounds the
#    step by the work spread over the cores), and beside it the one-process prediction (what Table 2 rests on).
# 3. GPipe paper Table 2 at K = --table-k (predicted for every registered schedule, interleaved with v=2): K ∈ {1, 2,
#    4, K} × M ∈ --table-ms, the same global batch, costs and the engine factor measured per M in one process, the
#    co-run factor of the K=2 launch; AmoebaNet-D with 18 normal cells so that 2 × 8 = 16 stages each get a layer.
#    Writes <out-dir>/schedules.{json,md,png} after the validation and again at the end (the tables:
#    _lib/costmodel_report.py). From the repo root: python -m benchmarks.schedules

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.costmodel import LayerCosts, engine_factor, predict
from benchmarks._lib.costmodel import profile_layers as profile
from benchmarks._lib.costmodel_ranks import (
    StageTimes,
    engines_of,
    one_stage_time,
    parts_rows,
    traced_kinds,
)
from benchmarks._lib.costmodel_report import TOLERANCE, V, markdown, relative, replay_row, table2
from benchmarks._lib.gloo_link import Link, echo, fit_host, fit_link, message_host, ping_pong
from benchmarks._lib.machine import (
    Runner,
    Timing,
    background_load,
    cpu_snapshot,
    foreign_load,
    launch,
    measure,
    stats,
    steady_heap,
    wait_quiet,
)
from benchmarks._lib.workloads import (
    SIZES,
    SMOKE_SIZES,
    build,
    describe,
    loss_fn,
    make_batch,
    per_micro_batch,
)
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.microbatch import plan_sizes
from lightning_gpipe.pipe.schedule.registry import SCHEDULES
from lightning_gpipe.pipe.state.rematerialize import Checkpoint

# Those the runtime runs; "zb-v" (two chunks per rank in a V) is predicted only until the runtime places chunks so.
RUNNABLE = [name for name, spec in SCHEDULES.items() if spec.placement == "loop"]
# Per v (virtual stages per rank): the schedule whose balance the measured stage uses.
RUN_ON = {1: "gpipe", 2: "interleaved-1f1b"}
PING_BYTES = [64, 16 << 10, 256 << 10, 1 << 20, 4 << 20]


def table_sizes(sizes: dict[str, dict[str, Any]], smoke: bool) -> dict[str, dict[str, Any]]:
    """The Table 2 models: AmoebaNet-D with 18 normal cells (24 layers: room for 16 stages), the Transformer as is."""
    return sizes if smoke else {**sizes, "amoebanet": {**sizes["amoebanet"], "num_layers": 18}}


def quietly(fn: Callable[[], Any], args: argparse.Namespace) -> tuple[Any, float]:
    """``fn()`` on a quiet machine if possible: rerun (3 tries) while other processes used ≥ --clean-threshold cores
    meanwhile; the least disturbed result, and the cores others used during it."""
    best: tuple[Any, float] | None = None
    for _ in range(1 if args.smoke else 3):
        wait_quiet(args.wait_quiet, args.clean_threshold)
        before = cpu_snapshot()
        result = fn()
        foreign = foreign_load(before, cpu_snapshot())["foreign_cores"] or 0.0
        if best is None or foreign < best[1]:
            best = (result, foreign)
        if foreign < args.clean_threshold:
            break
    assert best is not None
    return best


def costs_of(name: str, s: dict[str, Any], M: int, args: argparse.Namespace) -> tuple[LayerCosts, float]:
    """Per-layer costs of the model on one of M micro-batches of its global batch; the foreign load meanwhile. zb-h1's
    split halves with the ops that split at the smallest validated K (``weight_grad.split_pays``)."""
    x, target = make_batch(name, s, s["batch"] // M)
    lc = partial(profile, build(name, s), x, lambda y: loss_fn(y, target), repeat=args.repeat)
    return quietly(lambda: lc(split_shape=(min(args.ks), M)), args)


# A one-stage pipeline runs "always" for the engine factor: a middle stage's dropped forwards, recomputes and backwards
ENGINE_CHECKPOINT: Checkpoint = "always"


def one_stage_step(name: str, s: dict[str, Any], M: int, steps: int) -> float:
    """The median forward_backward of the whole model's one-stage pipeline in this process (the one-process engine)."""
    x, target = make_batch(name, s)
    loss = per_micro_batch(loss_fn, target, plan_sizes(x, M))
    return one_stage_time(build(name, s), x, loss, M, ENGINE_CHECKPOINT, steps)


# ---------------------------------------------------------------------------------------------------- workers
def train_step(stage: GPipeStage, optimizer: torch.optim.Optimizer, x: Any, loss: Any, schedule: str) -> None:
    stage.forward_backward(x if stage.is_first else None, loss, schedule=schedule)  # type: ignore[arg-type]
    with stage.timeline.record("update"):  # nothing unless a traced step turned the timeline on
        optimizer.step()


def runner(stage: GPipeStage, optimizer: torch.optim.Optimizer, x: Any, loss: Any, schedule: str) -> Runner:
    return Runner(partial(stage.zero_grad, set_to_none=True), partial(train_step, stage, optimizer, x, loss, schedule))


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One K (= world): gloo's ping-pong fit (K=2), then per model its runnable schedules' steps and the one-stage
    pipelines of each rank's stages (co-run and alone), all by turns, then five traced steps per schedule."""
    out: dict[str, Any] = {}
    for _ in range(2 if job["ping"] else 0):  # the first round warms the connection up; the second is kept
        if rank == 0:
            out["ping"] = ping_pong(1, PING_BYTES, repeat=15)
        elif rank == 1:
            echo(0, PING_BYTES, repeat=15)
        dist.barrier()
    if job["ping"]:  # what a message costs each end's own time, beside the link (gloo_link.fit_host)
        pair = dist.new_group([0, 1])
        if rank < 2:
            out["host"] = message_host(pair)
        dist.barrier()
    timing = job["timing"]
    single = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group, in one order
    for name, entry in job["models"].items():
        runners: dict[str, Runner] = {}
        stages: dict[str, GPipeStage] = {}
        x, target = make_batch(name, entry["sizes"])
        loss = per_micro_batch(loss_fn, target, plan_sizes(x, job["M"]))
        model = partial(build, name, entry["sizes"])
        clocks = {
            v: StageTimes(model, x, loss, balance, v, job["M"], single) for v, balance in entry["balance"].items()
        }
        for v in sorted({V.get(s, 1) for s in RUNNABLE}):  # one stage per chunks-per-rank, the same weights
            torch.manual_seed(0)
            stage = GPipeStage(
                build(name, entry["sizes"]),
                chunks=job["M"],
                balance=entry["balance"][v],
                checkpoint=job["checkpoint"],
                virtual_stages=v,
            )
            optimizer = torch.optim.RMSprop(stage.parameters(), lr=1e-4)
            per_micro = per_micro_batch(loss_fn, target, stage.micro_batch_sizes(x))
            runners |= {s: runner(stage, optimizer, x, per_micro, s) for s in RUNNABLE if V.get(s, 1) == v}
            stages |= {s: stage for s in RUNNABLE if V.get(s, 1) == v}
        for clock in clocks.values():
            runners |= clock.runners()
        records = measure(runners, timing).records
        out.setdefault("stages", {})[name] = {v: clock.rows(records) for v, clock in clocks.items()}
        out[name] = {s: records[s] for s in RUNNABLE}
        out.setdefault("traced", {})[name] = {s: traced_kinds(stages[s], runners[s], timing) for s in RUNNABLE}
    return out


# ------------------------------------------------------------------------------------------------------ tables
def plot(data: dict) -> Any:
    """Left: predicted against measured steps; then per model, the predicted speed-up against K per schedule."""
    models = list(data["table2"])
    fig, axes = report.subplots(1, 1 + len(models), figsize=(5.2 * (1 + len(models)), 4.4))
    ax = axes[0][0]
    rows = [r for r in data["validation"] if r.get("measured_ms")]
    top = max([r[k] for r in rows for k in ("measured_ms", "predicted_ms", "predicted_on_cores_ms")] + [1.0]) * 1.1
    ax.fill_between([0, top], [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)], color="0.9", label="±10 %")
    for i, r in enumerate(rows):
        over = r["K"] > data["usable_cores"]  # the prediction with the cores shared: max(step, work / cores)
        label = f"{r['model']} K={r['K']} {r['schedule']}" + (" (oversubscribed, cores shared)" if over else "")
        y = r["predicted_on_cores_ms"] if over else r["predicted_ms"]
        ax.scatter(r["measured_ms"], y, marker="x" if over else "o", color=f"C{i % 10}", label=label)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step (ms)", ylabel="predicted step (ms)")
    ax.set_title("predicted vs measured", fontsize=10)
    ax.legend(fontsize=6, loc="upper left")
    for ax, name in zip(axes[0][1:], models, strict=True):
        table = data["table2"][name]
        M = max(r["M"] for r in table)
        for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in table)):
            pts = [
                (r["K"], r["speedup"]) for r in table if r["M"] == M and r["schedule"] == schedule and "speedup" in r
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=schedule)
        ks = sorted({r["K"] for r in table})
        ax.plot(ks, [K * M / (M + K - 1) for K in ks], "k--", lw=1, label="ideal K·M/(M+K−1)")
        ax.set(xlabel="K (stages)", ylabel=f"predicted speed-up vs K=1, M={M}", xticks=ks)
        ax.set_title(f"{name} (predicted)", fontsize=10)
        ax.legend(fontsize=7)
    what = "Schedules by the simulator fed with measured per-layer costs (GPipe Table 2, predicted)"
    return report.title(fig, what, data["environment"])


def validate(
    models: dict[str, Any], raw: dict[int, Any], link: Link, args: argparse.Namespace, sizes: dict, cores: int
) -> tuple[list[dict], list[dict]]:
    """Every schedule's predicted step beside the measured one, per K and model, and the traced parts per rank."""
    M = args.micro_batches
    validation, parts = [], []
    for K in sorted(args.ks):
        for name, m in models.items():
            predicted = {}
            for schedule in SCHEDULES:
                v = V.get(schedule, 1)
                engines = engines_of(m["costs"], m["stages"][K][str(v)], M)
                predicted[schedule] = predict(
                    m["costs"], link, schedule, K, M, v, checkpoint=args.checkpoint, engines=engines
                )
            for schedule, p in predicted.items():
                v = V.get(schedule, 1)
                one = predict(m["costs"], link, schedule, K, M, v, checkpoint=args.checkpoint)
                row: dict[str, Any] = {"model": name, "K": K, "M": M, "schedule": schedule, "balance": p.balance}
                row |= {"predicted_ms": p.step * 1e3, "predicted_on_cores_ms": p.on_cores(cores) * 1e3}
                row["one_process_ms"] = one.step * 1e3
                notes = ["oversubscribed"] if K > cores else []
                if schedule in raw[K][name]:
                    st = stats(raw[K][name][schedule], sizes[name]["batch"])
                    row |= {"measured_ms": st["median_ms"], "clean_steps": st["clean_steps"]}
                    row["ratio"] = row["predicted_ms"] / row["measured_ms"]
                    row["ratio_on_cores"] = row["predicted_on_cores_ms"] / row["measured_ms"]
                    row["ratio_one_process"] = row["one_process_ms"] / row["measured_ms"]
                    row["within"] = "yes" if abs(row["ratio"] - 1) <= TOLERANCE else "no"
                    row |= relative(p.step / predicted["gpipe"].step, raw[K][name], schedule)
                    notes += ["noisy"] if st["noisy"] else []
                    traced = raw[K]["traced"][name][schedule]
                    parts += parts_rows(name, K, schedule, traced, p)
                    row |= replay_row(p, traced, link, args.checkpoint)
                else:
                    notes.append("not runnable: predicted only")
                row["note"] = ", ".join(notes)
                validation.append(row)
                print(f"# {row}", flush=True)
    return validation, parts


def table_2(models: dict[str, Any], link: Link, args: argparse.Namespace, sizes: dict) -> dict[str, list[dict]]:
    """Each model's Table 2, predicted from costs measured in this process per M (the co-run factor of the launch)."""
    tsizes = table_sizes(sizes, args.smoke)
    ks = sorted({1, 2, 4, args.table_k} - {0})
    table: dict[str, list[dict]] = {}
    for name, m in models.items():
        costs = {}
        for tm in args.table_ms:
            costs[tm], m["foreign_cores"][f"table costs M={tm}"] = costs_of(name, tsizes[name], tm, args)
            run = partial(one_stage_step, name, tsizes[name], tm, max(2, args.steps // 2))
            one, m["foreign_cores"][f"table one-stage M={tm}"] = quietly(run, args)
            costs[tm].engine = engine_factor(costs[tm], one, tm, ENGINE_CHECKPOINT)
            costs[tm].corun = m["costs"].corun
        table[name] = table2(name, costs, link, ks, tsizes[name]["batch"])
        models[name]["table_model"] = describe(name, tsizes[name])
        models[name]["table_costs"] = {tm: lc.as_dict() for tm, lc in costs.items()}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4], metavar="K", help="validated on K processes")
    parser.add_argument("--micro-batches", type=int, default=8, metavar="M", help="M of the validation")
    parser.add_argument("--table-k", type=int, default=8, help="the largest K of the predicted Table 2")
    parser.add_argument("--table-ms", type=int, nargs="+", default=[1, 4, 32], metavar="M")
    parser.add_argument("--repeat", type=int, default=7, help="repetitions per layer cost (medians)")
    # Six steps a schedule left the schedules of the same work 1.27x apart on the 2-core VM; thirty, 1.2 % apart.
    parser.add_argument("--steps", type=int, default=20, help="clean timed steps wanted per schedule")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clean-threshold", type=float, default=0.1)
    parser.add_argument("--wait-quiet", type=float, default=30.0)
    parser.add_argument("--checkpoint", choices=["except_last", "always", "never"], default="except_last")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="tiny models, K=2, 2 steps, no quiet waits")
    args = parser.parse_args()
    steady_heap()  # before the layers are profiled here, as the report says
    if args.smoke:
        args.ks, args.steps, args.max_steps, args.warmup, args.wait_quiet = [2], 2, 2, 1, 0.0
        args.micro_batches, args.table_k, args.table_ms, args.repeat = 4, 4, [4], 3
    torch.set_num_threads(1)
    t_start, load_before, snapshot = time.perf_counter(), os.getloadavg(), cpu_snapshot()
    sizes = SMOKE_SIZES if args.smoke else SIZES
    cores = len(os.sched_getaffinity(0))
    M = args.micro_batches
    timing = Timing(args.steps, max(args.steps, args.max_steps), args.warmup, args.clean_threshold, args.wait_quiet)
    models: dict[str, Any] = {}
    for name in args.models:
        lc, foreign = costs_of(name, sizes[name], M, args)
        one, foreign_one = quietly(partial(one_stage_step, name, sizes[name], M, args.steps), args)
        lc.engine = engine_factor(lc, one, M, ENGINE_CHECKPOINT)
        models[name] = {"describe": describe(name, sizes[name]), "costs": lc, "one_stage_step_ms": one * 1e3}
        models[name]["foreign_cores"] = {"costs": foreign, "one_stage_step": foreign_one}
        print(f"# {name}: one-stage forward_backward {one * 1e3:.1f} ms, engine factor {lc.engine:.3f}", flush=True)
    raw: dict[int, Any] = {}
    link: Link | None = None
    for K in sorted(args.ks):
        wait_quiet(args.wait_quiet, args.clean_threshold)
        entries = {
            n: {
                "sizes": sizes[n],
                "balance": {v: predict(m["costs"], Link(0, 1), RUN_ON[v], K, M, v).balance for v in RUN_ON},
            }
            for n, m in models.items()
        }
        job = {"M": M, "timing": timing, "checkpoint": args.checkpoint, "models": entries, "ping": link is None}
        raw[K] = launch(run_job, K, job)
        link = link or fit_host(fit_link([tuple(x) for x in raw[K]["ping"]]), raw[K]["host"])
        for n, m in models.items():
            m.setdefault("stages", {})[K] = raw[K]["stages"][n]
            if K == min(args.ks):  # the co-run factor that the one-process prediction carries to other K
                rows = [row for part in raw[K]["stages"][n].values() for row in part]
                m["costs"].corun = statistics.fmean(row["corun_s"] / row["alone_s"] for row in rows)
    assert link is not None, "--ks names at least one K"
    validation, parts = validate(models, raw, link, args, sizes, cores)
    data = {
        "command": report.command_line("schedules"),
        "environment": report.environment(threads_per_process=1, processes="one per stage (K), gloo on 127.0.0.1"),
        "usable_cores": cores,
        "smoke": args.smoke,
        "setup": {**vars(args), "runnable": RUNNABLE, "tolerance": TOLERANCE},
        "link": {
            "latency_s": link.latency,
            "bandwidth_bytes_per_s": link.bandwidth,
            "samples": link.samples,
            "send_host_s": {"fixed": link.send_host[0], "per_tensor": link.send_host[1]},
            "recv_host_s": {"fixed": link.recv_host[0], "per_tensor": link.recv_host[1]},
            "host_samples": link.host_samples,
        },
        "validation": validation,
        "parts": parts,
        "table2": {},
    }
    data["predicted_from"] = f"costs measured on {report.machine_label(data['environment'])}"
    # The validation is written before Table 2 measures its costs (minutes more), so a run cut off then keeps it.
    write(data, models, link, args, (snapshot, load_before))
    data["table2"] = table_2(models, link, args, sizes)
    data["total_s"] = time.perf_counter() - t_start
    write(data, models, link, args, (snapshot, load_before))


def write(data: dict, models: dict[str, Any], link: Link, args: argparse.Namespace, before: tuple[dict, tuple]) -> None:
    """The results files from ``data`` as it stands (the models' costs as dicts), and the tables printed."""
    data["machine_check"], load_line = background_load(*before)
    data["models"] = {n: {**m, "costs": m["costs"].as_dict()} for n, m in models.items()}
    md = markdown(data, models, link, args, load_line)
    paths = report.write("schedules", data, "\n".join(md), out_dir=args.out_dir, plot=plot)
    print("\n".join(md))
    took = f" ({data['total_s']:.0f} s)" if "total_s" in data else " (the validation; Table 2 follows)"
    print(f"# wrote {', '.join(paths.values())}{took}", flush=True)


if __name__ == "__main__":
    main()
