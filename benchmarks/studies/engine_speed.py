"""Time the GPipe engine on 8 Transformer encoder layers at K=1 and K=2, against torch.distributed.pipelining."""

# What it runs and how it times: benchmarks/results/engine_speed/README.md. Run it from the repo root:
# python -m benchmarks.studies.engine_speed

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib import report
from benchmarks._lib import workloads as wl
from benchmarks._lib.machine import (
    Timing,
    add_timing_args,
    background_load,
    cpu_snapshot,
    engine_commit,
    launch,
    max_over_ranks,
    measure,
    probe,
    stats,
    wait_quiet,
    zeroed,
)
from benchmarks._lib.pipe_trace import stage_lines, trace_step
from benchmarks._lib.workloads import (
    build_encoder,
    build_torch,
    encoder_batch,
    grads,
    ours_step,
    plain_step,
    torch_step,
)
from lightning_gpipe.pipe import GPipeStage


# ------------------------------------------------------------------------------------------------------ workers
def run_job(rank: int, world: int, job: dict) -> dict:
    """A worker's whole job: every M at its world size, in turn (at K=1, after the plain reference)."""
    wl.configure(job["shape"])  # a spawned worker starts from workloads' full sizes
    model, (x, y) = build_encoder(), encoder_batch()
    # Each K=2 pipeline talks on its own process group, so their messages can never meet.
    groups = (dist.new_group([0, 1]), dist.new_group([0, 1])) if world == 2 else ()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, probe())
    out: dict[str, Any] = {"probe_gflops": gathered}
    if world == 1:
        # Reference: the same model, forward + loss + backward as one batch, no engine and no re-materialization.
        plain = copy.deepcopy(model)
        m = measure({"plain": zeroed(plain, lambda: plain_step(plain, x, y))}, job["timing"])
        out["plain"] = {"plain": m.records["plain"], "paused_s": m.paused_s}
    for M in job["micro_batches"]:
        out[str(M)] = k1_config(model, x, y, M, job) if world == 1 else k2_config(model, x, y, M, rank, groups, job)
    return out


def k1_config(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, M: int, job: dict) -> dict:
    stage = GPipeStage(copy.deepcopy(model), chunks=M, balance=[wl.LAYERS], checkpoint=job["checkpoint"])
    m = measure({"ours": zeroed(stage, lambda: ours_step(stage, x, y))}, job["timing"])
    return {"ours": m.records["ours"], "ours_first_loss": m.first["ours"], "paused_s": m.paused_s}


def k2_config(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, M: int, rank: int, groups: tuple, job: dict
) -> dict:
    """Ours and torch's pipelines on the same weights, timed alternately step by step in the same two processes."""
    balance = [wl.LAYERS // 2] * 2  # build_torch's split
    ours = GPipeStage(copy.deepcopy(model), chunks=M, balance=balance, checkpoint=job["checkpoint"], group=groups[0])
    schedule, torch_module = build_torch(model, rank, M, groups[1], job["torch_checkpoint"])
    grad_diff: list[float] = []

    def compare_grads() -> None:
        # After step 0 both hold the gradients of the same weights on the same batch: they should agree.
        diff = max((a - b).abs().max().item() for a, b in zip(grads(ours), grads(torch_module)))
        grad_diff.append(max_over_ranks(diff))

    runners = {
        "ours": zeroed(ours, lambda: ours_step(ours, x, y)),
        "torch": zeroed(torch_module, lambda: torch_step(schedule, rank == 1, x, y)),
    }
    m = measure(runners, job["timing"], after_first=compare_grads)
    entry: dict[str, Any] = {
        "ours": m.records["ours"],
        "torch": m.records["torch"],
        "ours_first_loss": m.first["ours"],
        "torch_first_loss": m.first["torch"],
        "max_abs_grad_diff": grad_diff[0],
        "paused_s": m.paused_s,
    }
    if job["trace"] and M == job["trace_m"]:
        entry["trace"] = trace_step(ours, lambda: ours_step(ours, x, y), job["timing"], job["trace_path"])
    return entry


# ------------------------------------------------------------------------------------------------------- driver
def parse_args() -> tuple[argparse.Namespace, Timing]:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8, 16], metavar="M")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument(
        "--torch-checkpoint",
        default="stage",
        choices=["stage", "layer"],
        help="torch.utils.checkpoint around each stage's 4 layers as one call (stage) or around each layer",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat the K=2 job and the K=1 job this many times")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=str(report.RESULTS), help="writes engine_speed.json and .md there")
    where.add_argument("--out", default=None, help="the JSON's path instead (the Markdown beside it, same stem)")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace of one K=2 step of ours")
    parser.add_argument("--trace-m", type=int, default=8, help="the M of the traced step")
    parser.add_argument("--smoke", action="store_true", help="a small encoder stack, M=2, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        wl.configure(wl.SMOKE_ENCODER)
        args.micro_batches, args.rounds, args.trace_m = [2], 1, 2
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    if max(args.micro_batches) > wl.BATCH or min(args.micro_batches) < 1:
        parser.error(f"M must be in 1..{wl.BATCH}")
    return args, timing


def tabulate(raw: dict[str, list[dict]], micro_batches: list[int]) -> tuple[list[dict], list[dict]]:
    """Per-configuration statistics (the rounds' steps pooled) and, per M, the speed-ups and sanity checks."""

    def pooled(k: str, key: str, name: str) -> dict:
        return stats([rec for run in raw[k] for rec in run[key][name]], wl.BATCH)

    def paused(k: str, key: str) -> float:
        return sum(run[key]["paused_s"] for run in raw[k])

    configs = [{"config": "plain K=1", "M": 1, **pooled("k1", "plain", "plain"), "paused_s": paused("k1", "plain")}]
    summary: list[dict] = []
    K = 2
    for M in micro_batches:
        key = str(M)
        k1, k2, tk = pooled("k1", key, "ours"), pooled("k2", key, "ours"), pooled("k2", key, "torch")
        configs += [
            {"config": "ours K=1", "M": M, **k1, "paused_s": paused("k1", key)},
            {"config": "ours K=2", "M": M, **k2, "paused_s": paused("k2", key)},
            {"config": "torch GPipe K=2", "M": M, **tk, "paused_s": paused("k2", key)},
        ]
        ideal = K * M / (M + K - 1)
        speedup = k1["median_ms"] / k2["median_ms"]
        first = raw["k2"][0][key]
        summary.append(
            {
                "M": M,
                "ours_k1_ms": k1["median_ms"],
                "ours_k2_ms": k2["median_ms"],
                "torch_k2_ms": tk["median_ms"],
                "speedup_k2_over_k1": speedup,
                "ideal_speedup": ideal,
                "speedup_over_ideal": speedup / ideal,
                "speedup_target_met": speedup / ideal >= 0.9,
                "torch_speedup_over_ours_k1": k1["median_ms"] / tk["median_ms"],
                "ours_over_torch_throughput": tk["median_ms"] / k2["median_ms"],
                "throughput_target_met": tk["median_ms"] / k2["median_ms"] >= 1.1,
                "loss_ours_k1": raw["k1"][0][key]["ours_first_loss"],
                "loss_ours_k2": first["ours_first_loss"],
                "loss_torch_k2": first["torch_first_loss"],
                "max_abs_grad_diff_ours_vs_torch": first["max_abs_grad_diff"],
            }
        )
    return configs, summary


def print_tables(configs: list[dict], summary: list[dict], trace: dict | None, trace_m: int) -> None:
    print()
    print(
        f"{'config':<16} {'M':>3} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'samples/s':>10} "
        f"{'clean/timed':>12} {'own cores':>10} {'paused s':>9}"
    )
    for c in configs:
        print(
            f"{c['config']:<16} {c['M']:>3} {c['median_ms']:>10.1f} {c['min_ms']:>9.1f} {c['max_ms']:>9.1f} "
            f"{c['samples_per_s']:>10.1f} {c['clean_steps']:>5}/{c['timed_steps']:<6} {c['median_own_cores']:>10.2f} "
            f"{c['paused_s']:>9.0f}" + ("  (noisy: all steps)" if c["noisy"] else "")
        )
    print()
    print(
        f"{'M':>3} {'speed-up K2/K1':>15} {'ideal KM/(M+K-1)':>17} {'ratio':>6} {'≥0.9?':>6} "
        f"{'ours/torch thr.':>16} {'≥1.1?':>6} {'torch K2/K1':>12}"
    )
    for s in summary:
        print(
            f"{s['M']:>3} {s['speedup_k2_over_k1']:>15.2f} {s['ideal_speedup']:>17.2f} {s['speedup_over_ideal']:>6.2f} "
            f"{'yes' if s['speedup_target_met'] else 'NO':>6} {s['ours_over_torch_throughput']:>16.2f} "
            f"{'yes' if s['throughput_target_met'] else 'NO':>6} {s['torch_speedup_over_ours_k1']:>12.2f}"
        )
    print("(targets: ratio ≥ 0.9 at M=4 and M=8; ours/torch ≥ 1.1 at M=8)")
    print()
    print("sanity, first step (same weights and batch): loss ours K=1 / ours K=2 / torch K=2, max |grad ours - torch|")
    for s in summary:
        d = abs(s["loss_ours_k2"] - s["loss_torch_k2"])
        print(
            f"  M={s['M']:>2}: {s['loss_ours_k1']:.6f} / {s['loss_ours_k2']:.6f} / {s['loss_torch_k2']:.6f} "
            f"(|ours - torch| = {d:.2e}), grad diff {s['max_abs_grad_diff_ours_vs_torch']:.2e}"
        )
    if trace:
        print(
            f"\ntrace of one K=2 M={trace_m} step of ours: {trace['path']} (span {trace['span_ms']:.1f} ms, "
            f"other processes {trace['step']['foreign_cores']:.2f} cores meanwhile)"
        )
        print("\n".join(stage_lines(trace)))


def main() -> None:
    args, timing = parse_args()
    out_path = Path(args.out) if args.out else Path(args.out_dir) / "engine_speed.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    job = {
        "shape": {k: getattr(wl, k) for k in wl.SMOKE_ENCODER},  # the sizes parse_args chose, for the workers
        "timing": timing,
        "micro_batches": args.micro_batches,
        "checkpoint": args.checkpoint,
        "torch_checkpoint": args.torch_checkpoint,
        "trace": False,
        "trace_m": args.trace_m,
        "trace_path": str(out_path.with_name(f"engine_trace_k2_m{args.trace_m}.json")),
    }

    info = report.environment(threads_per_process=1, processes="1 (K=1) or 2 (K=2), fresh per job (gloo)")
    shape = f"{wl.LAYERS} x TransformerEncoderLayer(d={wl.D_MODEL}, heads={wl.HEADS}, ffn={wl.FFN})"
    print(
        f"# {info['cpu_model']}, {info['usable_cores']} usable cores, torch {info['torch']}, {info['date']}\n"
        f"# {shape}, batch {wl.BATCH}x{wl.SEQ}, "
        f"{args.warmup} warm-up + {args.steps} clean timed steps (≤ {timing.max_steps}) x {args.rounds} round(s), "
        f"ours checkpoint={args.checkpoint}, torch checkpoint per {args.torch_checkpoint}",
        flush=True,
    )
    load_before = os.getloadavg()
    raw: dict[str, list[dict]] = {"k2": [], "k1": []}
    order: list[str] = []
    t_start = time.perf_counter()
    snap_before = cpu_snapshot()
    for r in range(args.rounds):
        # Within a round: the K=2 job (ours and torch alternating step by step), then the K=1 job.
        for world, name in ((2, "K=2 ours/torch alternating"), (1, "K=1 ours")):
            waited = wait_quiet(args.wait_quiet, args.clean_threshold)
            t0, commit = time.perf_counter(), engine_commit()
            raw[f"k{world}"].append(launch(run_job, world, dict(job, trace=args.trace and r == 0 and world == 2)))
            order.append(
                f"round {r}: {name}, M={args.micro_batches} ({time.perf_counter() - t0:.0f} s"
                + (f", after waiting {waited:.0f} s for a quiet machine" if waited >= 3 else "")
                + f"; engine {commit} at spawn)"
            )
            print(f"# {order[-1]}", flush=True)
    background, background_line = background_load(snap_before, load_before)
    probes = {
        "k1_alone_gflops": [g for run in raw["k1"] for g in run["probe_gflops"]],
        "k2_concurrent_gflops_per_rank": [g for run in raw["k2"] for g in run["probe_gflops"]],
    }
    configs, summary = tabulate(raw, args.micro_batches)
    traced = [run[str(args.trace_m)] for run in raw["k2"] if str(args.trace_m) in run]
    trace = next((entry["trace"] for entry in traced if "trace" in entry), None)
    print_tables(configs, summary, trace, args.trace_m)

    total = time.perf_counter() - t_start
    alone = statistics.median(probes["k1_alone_gflops"])
    pair = probes["k2_concurrent_gflops_per_rank"]
    machine_line = (
        f"# machine check: one process alone {alone:.0f} GFLOP/s (512x512 matmul, 1 thread); two at once "
        f"{' and '.join(f'{g:.0f}' for g in pair)} GFLOP/s each (parallel efficiency "
        f"{statistics.mean(pair) / alone:.2f})"
    )
    print("\n" + machine_line)
    print(background_line)
    commit_after = engine_commit()
    if commit_after != info["engine_commit"]:
        print(
            f"# WARNING: lightning_gpipe/ changed during the run ({info['engine_commit']} -> {commit_after}); "
            "each job's line above says what its workers imported"
        )
    print(f"# total {total:.0f} s")

    result = {
        "command": report.command_line("studies.engine_speed"),
        "environment": info,
        "engine_commit_after": commit_after,
        "machine_check": {**probes, **background},
        "setup": {
            "model": f"{wl.LAYERS} x nn.TransformerEncoderLayer(d_model={wl.D_MODEL}, nhead={wl.HEADS}, "
            f"dim_feedforward={wl.FFN}, dropout=0.0, batch_first=True)",
            "batch": [wl.BATCH, wl.SEQ, wl.D_MODEL],
            "loss": "MSE on the last stage",
            "threads_per_process": 1,
            "backend": "gloo, 127.0.0.1",
            "ours_checkpoint": args.checkpoint,
            "torch_checkpoint": f"torch.utils.checkpoint(use_reentrant=False) per {args.torch_checkpoint}, every "
            "micro-batch; ScheduleGPipe(loss_fn=F.mse_loss), step(..., return_outputs=False)",
            "warmup_steps": args.warmup,
            "clean_steps_wanted": args.steps,
            "max_timed_steps": timing.max_steps,
            "clean_threshold_cores": args.clean_threshold,
            "rounds": args.rounds,
            "step_time": "barrier; forward+loss+backward; barrier; max over ranks (grads zeroed before, no optimizer)",
            "order": order,
        },
        "configs": configs,
        "summary": summary,
        "trace": trace,
        "total_s": total,
    }
    md = markdown(result, f"{shape}, batch {wl.BATCH}x{wl.SEQ}", [machine_line, background_line])
    paths = report.write(out_path.stem, result, md, out_dir=out_path.parent)
    print(f"# wrote {', '.join(paths.values())}")


CONFIG_COLUMNS: list[report.Column] = [
    ("config", "config", ""),
    ("M", "M", ""),
    ("median_ms", "median ms/step", ".1f"),
    ("min_ms", "min", ".1f"),
    ("max_ms", "max", ".1f"),
    ("samples_per_s", "samples/s", ".1f"),
    ("clean_steps", "clean steps", ""),
    ("timed_steps", "timed steps", ""),
    ("noisy", "noisy", ""),
]
SUMMARY_COLUMNS: list[report.Column] = [
    ("M", "M", ""),
    ("speedup_k2_over_k1", "speed-up ours K=2 / K=1", ".2f"),
    ("ideal_speedup", "ideal K·M/(M+K−1)", ".2f"),
    ("speedup_over_ideal", "speed-up / ideal (target ≥ 0.9)", ".2f"),
    ("ours_over_torch_throughput", "ours / torch throughput, K=2 (target ≥ 1.1)", ".2f"),
    ("torch_speedup_over_ours_k1", "torch K=2 / ours K=1", ".2f"),
    ("max_abs_grad_diff_ours_vs_torch", "max abs grad diff ours vs torch", ".1e"),
]


def markdown(result: dict, model: str, checks: list[str]) -> str:
    """The results file's tables, with the environment, the command and the machine check."""
    setup = result["setup"]
    lines = ["# The engine at K=1 and K=2 against torch.distributed.pipelining's ScheduleGPipe", ""]
    lines += [*report.environment_lines(result["environment"]), f"- Command: `{result['command']}`"]
    lines += [f"- {model}; ours checkpoint={setup['ours_checkpoint']}, torch: {setup['torch_checkpoint']}"]
    lines += [f"- Step time: {setup['step_time']}; total {result['total_s']:.0f} s", ""]
    lines += [report.markdown_table(result["configs"], CONFIG_COLUMNS), ""]
    lines += [report.markdown_table(result["summary"], SUMMARY_COLUMNS), ""]
    return "\n".join(lines + [line.lstrip("# ") for line in checks])


if __name__ == "__main__":
    main()
