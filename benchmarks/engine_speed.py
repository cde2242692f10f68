"""Time the GPipe engine on 8 Transformer encoder layers at K=1 and K=2, against torch.distributed.pipelining.

One command does the whole run::

    python benchmarks/engine_speed.py

The script spawns its own worker processes (gloo on 127.0.0.1, one thread each) for every job:

* ``ours K=1``: one process (world size 1), ``PipelineStage(..., balance=[8])``, for each M;
* ``K=2``: two processes; for each M, ``lightning_gpipe``'s ``PipelineStage(balance=[4, 4])`` and
  ``torch.distributed.pipelining``'s ``ScheduleGPipe`` are built from the same weights and timed **step by step
  alternately** (ours, torch, ours, torch, ...), each on its own process group, so the two share the machine's state.

Each timed step is ``barrier; forward + loss + backward (no optimizer; grads zeroed before); barrier``; a step's
time is the max over ranks. Medians (and min/max) over the timed steps are reported, after warm-up steps.

torch's stages are re-materialized the GPipe way: each stage's 4 layers run as **one**
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` call, so a stage keeps only its input per micro-batch
(what ``lightning_gpipe`` keeps for a checkpointed micro-batch). ``--torch-checkpoint layer`` checkpoints each layer
instead (4 saved inputs per stage, same compute). torch checkpoints every micro-batch; ``lightning_gpipe``'s default
``except_last`` keeps the graph of the last one (``--checkpoint always`` makes the two schedules do the same work).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# Importable as ``python benchmarks/engine_speed.py`` from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_gpipe.pipe import PipelineStage, gather_events, write_chrome_trace  # noqa: E402

LAYERS, D_MODEL, HEADS, FFN = 8, 256, 8, 1024
BATCH, SEQ = 64, 32
SEED = 0


# ------------------------------------------------------------------------------------------------ model and data
def build_model() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FFN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        ]
    )


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(BATCH, SEQ, D_MODEL, generator=g), torch.randn(BATCH, SEQ, D_MODEL, generator=g)


class CheckpointedStage(nn.Module):
    """torch's stage module: its layers re-materialized in the backward pass by torch.utils.checkpoint."""

    def __init__(self, layers: list[nn.Module], mode: str) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.mode == "stage":
            return checkpoint(self.layers, x, use_reentrant=False)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


# ---------------------------------------------------------------------------------------------------- one step
def ours_step(stage: PipelineStage, x: torch.Tensor, y: torch.Tensor) -> float | None:
    out = stage(x if stage.is_first else None)
    loss = None
    if stage.is_last:
        loss = F.mse_loss(out, y)
        loss.backward()
    stage.backward()
    return None if loss is None else loss.item()


def torch_step(schedule: Any, stage_index: int, num_stages: int, x: torch.Tensor, y: torch.Tensor) -> float | None:
    if stage_index == num_stages - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses, return_outputs=False)
        # Per-micro-batch MSE means over equal micro-batches: their mean is the full-batch MSE.
        return torch.stack([loss.detach() for loss in losses]).mean().item()
    schedule.step(x, return_outputs=False)
    return None


def timed(fn: Any) -> tuple[float, Any]:
    """Wall time of one step between two barriers: the max over ranks, in seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    t1 = time.perf_counter()
    dist.barrier()
    dt = torch.tensor([t1 - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), result


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def broadcast_from_last(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


# ------------------------------------------------------------------------------------------------------ workers
def _init(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )


def worker(rank: int, world: int, port: int, job: dict, result_path: str) -> None:
    _init(rank, world, port)
    try:
        result = run_k1(job) if world == 1 else run_k2(rank, job)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_k1(job: dict) -> dict:
    model, (x, y) = build_model(), make_batch()
    out: dict[str, Any] = {}
    for M in job["micro_batches"]:
        stage = PipelineStage(copy.deepcopy(model), chunks=M, balance=[LAYERS], checkpoint=job["checkpoint"])
        times, first_loss = [], None
        for s in range(job["warmup"] + job["steps"]):
            stage.zero_grad(set_to_none=True)
            dt, loss = timed(lambda: ours_step(stage, x, y))
            first_loss = loss if first_loss is None else first_loss
            if s >= job["warmup"]:
                times.append(dt)
        out[str(M)] = {"times_s": times, "first_loss": first_loss}
        del stage
    return out


def build_torch(model: nn.Sequential, rank: int, M: int, group: Any, mode: str) -> tuple[Any, nn.Module]:
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleGPipe

    half = LAYERS // 2
    layers = list(copy.deepcopy(model))[rank * half : (rank + 1) * half]
    module = CheckpointedStage(layers, mode)
    stage = TorchStage(module, rank, 2, torch.device("cpu"), group=group)
    return ScheduleGPipe(stage, n_microbatches=M, loss_fn=F.mse_loss), module


def run_k2(rank: int, job: dict) -> dict:
    model, (x, y) = build_model(), make_batch()
    ours_group = dist.new_group([0, 1])
    torch_group = dist.new_group([0, 1])
    out: dict[str, Any] = {}
    for M in job["micro_batches"]:
        ours = PipelineStage(
            copy.deepcopy(model), chunks=M, balance=[4, 4], checkpoint=job["checkpoint"], group=ours_group
        )
        schedule, torch_module = build_torch(model, rank, M, torch_group, job["torch_checkpoint"])
        ours_times, torch_times = [], []
        ours_loss = torch_loss = grad_diff = None
        for s in range(job["warmup"] + job["steps"]):
            ours.zero_grad(set_to_none=True)
            torch_module.zero_grad(set_to_none=True)
            # Alternate which framework goes first, so neither always runs right after the other.
            order = ("ours", "torch") if s % 2 == 0 else ("torch", "ours")
            for which in order:
                if which == "ours":
                    dt, loss = timed(lambda: ours_step(ours, x, y))
                    if s == 0:
                        ours_loss = broadcast_from_last(loss)
                    if s >= job["warmup"]:
                        ours_times.append(dt)
                else:
                    dt, loss = timed(lambda: torch_step(schedule, rank, 2, x, y))
                    if s == 0:
                        torch_loss = broadcast_from_last(loss)
                    if s >= job["warmup"]:
                        torch_times.append(dt)
            if s == 0:  # same weights, same batch: the two pipelines' parameter gradients should agree
                diff = max((a - b).abs().max().item() for a, b in zip(grads(ours), grads(torch_module)))
                grad_diff = max_over_ranks(diff)
        entry: dict[str, Any] = {
            "ours_times_s": ours_times,
            "torch_times_s": torch_times,
            "ours_first_loss": ours_loss,
            "torch_first_loss": torch_loss,
            "max_abs_grad_diff": grad_diff,
        }
        if job["trace"] and M == job["trace_m"]:
            entry["trace"] = trace_one_step(ours, x, y, job["trace_path"])
        out[str(M)] = entry
        del ours, schedule, torch_module
    return out


def trace_one_step(stage: PipelineStage, x: torch.Tensor, y: torch.Tensor, path: str) -> dict:
    """One extra K=2 step with the timeline on: the Chrome trace, and each stage's time per event kind."""
    stage.zero_grad(set_to_none=True)
    stage.timeline.clear()
    stage.timeline.enabled = True
    dist.barrier()
    ours_step(stage, x, y)
    dist.barrier()
    stage.timeline.enabled = False
    events = gather_events(stage.timeline)
    stage.timeline.clear()
    if dist.get_rank() != 0:
        return {}
    write_chrome_trace(events, path)
    steps = [e for e in events if e.kind == "step"]
    span = (max(e.end_ns for e in steps) - min(e.start_ns for e in steps)) / 1e6
    summary: dict[str, Any] = {"path": path, "span_ms": span, "stages": {}}
    for k in sorted({e.stage for e in events}):
        mine = [e for e in events if e.stage == k]
        per_kind: dict[str, float] = {}
        for e in mine:
            if e.kind != "step":
                per_kind[e.kind] = per_kind.get(e.kind, 0.0) + (e.end_ns - e.start_ns) / 1e6
        phases = {e.label: (e.end_ns - e.start_ns) / 1e6 for e in mine if e.kind == "step"}
        busy = sum(per_kind.get(kind, 0.0) for kind in ("forward", "recompute", "backward"))
        units = {
            kind: statistics.median([(e.end_ns - e.start_ns) / 1e6 for e in mine if e.kind == kind])
            for kind in ("forward", "recompute", "backward")
            if any(e.kind == kind for e in mine)
        }
        summary["stages"][str(k)] = {
            "ms_per_kind": per_kind,
            "phase_ms": phases,
            "compute_ms": busy,
            "compute_fraction_of_span": busy / span if span else None,
            "median_unit_ms": units,
        }
    return summary


# ------------------------------------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, job: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, free_port(), job, path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def machine_info() -> dict:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def stats(times: list[float]) -> dict:
    return {
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "samples_per_s": BATCH / statistics.median(times),
        "n": len(times),
        "times_ms": [t * 1e3 for t in times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round (≥ 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8, 16], metavar="M")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument(
        "--torch-checkpoint",
        default="stage",
        choices=["stage", "layer"],
        help="torch.utils.checkpoint around each stage's 4 layers as one call (stage) or around each layer",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeat the K=2 job and the K=1 job this many times")
    parser.add_argument("--out", default="benchmarks/results/engine_speed.json")
    parser.add_argument("--trace", action="store_true", help="also write a Chrome trace of one K=2 step of ours")
    parser.add_argument("--trace-m", type=int, default=8, help="the M of the traced step")
    args = parser.parse_args()
    if args.steps < 5:
        parser.error("--steps must be ≥ 5")
    if max(args.micro_batches) > BATCH or min(args.micro_batches) < 1:
        parser.error(f"M must be in 1..{BATCH}")

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path = out_path.with_name(f"engine_trace_k2_m{args.trace_m}.json")
    job = {
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "warmup": args.warmup,
        "checkpoint": args.checkpoint,
        "torch_checkpoint": args.torch_checkpoint,
        "trace": False,
        "trace_m": args.trace_m,
        "trace_path": str(trace_path),
    }

    info = machine_info()
    print(
        f"# {info['cpu_model']}, {info['usable_cores']} usable cores, torch {info['torch']}, {info['date']}\n"
        f"# {LAYERS} x TransformerEncoderLayer(d={D_MODEL}, heads={HEADS}, ffn={FFN}), batch {BATCH}x{SEQ}, "
        f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s), ours checkpoint="
        f"{args.checkpoint}, torch checkpoint per {args.torch_checkpoint}",
        flush=True,
    )
    raw: dict[str, list[dict]] = {"k2": [], "k1": []}
    order: list[str] = []
    t_start = time.perf_counter()
    for r in range(args.rounds):
        # Order within a round: the K=2 job (ours and torch alternating step by step), then the K=1 job.
        k2_job = dict(job, trace=args.trace and r == 0)
        t0 = time.perf_counter()
        raw["k2"].append(launch(2, k2_job))
        order.append(f"round {r}: K=2 ours/torch alternating, M={args.micro_batches} ({time.perf_counter() - t0:.0f} s)")
        print(f"# {order[-1]}", flush=True)
        t0 = time.perf_counter()
        raw["k1"].append(launch(1, job))
        order.append(f"round {r}: K=1 ours, M={args.micro_batches} ({time.perf_counter() - t0:.0f} s)")
        print(f"# {order[-1]}", flush=True)

    configs: list[dict] = []
    summary: list[dict] = []
    for M in args.micro_batches:
        key = str(M)
        k1 = stats([t for run in raw["k1"] for t in run[key]["times_s"]])
        k2 = stats([t for run in raw["k2"] for t in run[key]["ours_times_s"]])
        tk = stats([t for run in raw["k2"] for t in run[key]["torch_times_s"]])
        configs += [
            {"config": "ours K=1", "M": M, **k1},
            {"config": "ours K=2", "M": M, **k2},
            {"config": "torch GPipe K=2", "M": M, **tk},
        ]
        K = 2
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
                "torch_speedup_over_ours_k1": k1["median_ms"] / tk["median_ms"],
                "ours_over_torch_throughput": tk["median_ms"] / k2["median_ms"],
                "loss_ours_k1": raw["k1"][0][key]["first_loss"],
                "loss_ours_k2": first["ours_first_loss"],
                "loss_torch_k2": first["torch_first_loss"],
                "max_abs_grad_diff_ours_vs_torch": first["max_abs_grad_diff"],
            }
        )

    print()
    print(f"{'config':<16} {'M':>3} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'samples/s':>10}")
    for c in configs:
        print(
            f"{c['config']:<16} {c['M']:>3} {c['median_ms']:>10.1f} {c['min_ms']:>9.1f} {c['max_ms']:>9.1f} "
            f"{c['samples_per_s']:>10.1f}"
        )
    print()
    print(
        f"{'M':>3} {'speed-up K2/K1':>15} {'ideal KM/(M+K-1)':>17} {'ratio':>6} {'≥0.9?':>6} "
        f"{'ours/torch thr.':>16} {'≥1.1?':>6} {'torch K2/K1':>12}"
    )
    for s in summary:
        print(
            f"{s['M']:>3} {s['speedup_k2_over_k1']:>15.2f} {s['ideal_speedup']:>17.2f} {s['speedup_over_ideal']:>6.2f} "
            f"{'yes' if s['speedup_over_ideal'] >= 0.9 else 'NO':>6} {s['ours_over_torch_throughput']:>16.2f} "
            f"{'yes' if s['ours_over_torch_throughput'] >= 1.1 else 'NO':>6} {s['torch_speedup_over_ours_k1']:>12.2f}"
        )
    print()
    print("sanity, first step (same weights and batch): loss ours K=1 / ours K=2 / torch K=2, max |grad ours - torch|")
    for s in summary:
        d = abs(s["loss_ours_k2"] - s["loss_torch_k2"])
        print(
            f"  M={s['M']:>2}: {s['loss_ours_k1']:.6f} / {s['loss_ours_k2']:.6f} / {s['loss_torch_k2']:.6f} "
            f"(|ours - torch| = {d:.2e}), grad diff {s['max_abs_grad_diff_ours_vs_torch']:.2e}"
        )
    trace = next((run[str(args.trace_m)].get("trace") for run in raw["k2"] if "trace" in run.get(str(args.trace_m), {})), None)
    if trace:
        print(f"\ntrace of one K=2 M={args.trace_m} step of ours: {trace['path']} (span {trace['span_ms']:.1f} ms)")
        for k, st in trace["stages"].items():
            kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["ms_per_kind"].items())
            units = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["median_unit_ms"].items())
            print(
                f"  stage {k}: compute {st['compute_ms']:.1f} ms = {100 * st['compute_fraction_of_span']:.0f}% of the "
                f"span; totals [ms] {kinds}; median per micro-batch [ms] {units}"
            )
    total = time.perf_counter() - t_start
    print(f"\n# total {total:.0f} s")

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": info,
        "setup": {
            "model": f"{LAYERS} x nn.TransformerEncoderLayer(d_model={D_MODEL}, nhead={HEADS}, "
            f"dim_feedforward={FFN}, dropout=0.0, batch_first=True)",
            "batch": [BATCH, SEQ, D_MODEL],
            "loss": "MSE on the last stage",
            "threads_per_process": 1,
            "backend": "gloo, 127.0.0.1",
            "ours_checkpoint": args.checkpoint,
            "torch_checkpoint": f"torch.utils.checkpoint(use_reentrant=False) per {args.torch_checkpoint}, every "
            "micro-batch; ScheduleGPipe(loss_fn=F.mse_loss), step(..., return_outputs=False)",
            "warmup_steps": args.warmup,
            "timed_steps_per_round": args.steps,
            "rounds": args.rounds,
            "step_time": "barrier; forward+loss+backward; barrier; max over ranks (grads zeroed before, no optimizer)",
            "order": order,
        },
        "configs": configs,
        "summary": summary,
        "trace": trace,
        "total_s": total,
    }
    out_path.write_text(json.dumps(result, indent=2))
    print(f"# wrote {out_path}")


if __name__ == "__main__":
    main()
