"""Time the GPipe engine on 8 Transformer encoder layers at K=1 and K=2, against torch.distributed.pipelining.

One command does the whole run::

    python benchmarks/engine_speed.py

The script spawns its own worker processes (gloo on 127.0.0.1, one thread each) for every job:

* ``K=2``: two processes; for each M, ``lightning_gpipe``'s ``PipelineStage(balance=[4, 4])`` and
  ``torch.distributed.pipelining``'s ``ScheduleGPipe`` are built from the same weights and timed **step by step
  alternately** (the order flips every step), each on its own process group, so the two share the machine's state;
* then ``K=1``: one process (world size 1): the plain model without the engine (a reference), then
  ``PipelineStage(..., balance=[8])`` for each M.

Each timed step is ``barrier; forward + loss + backward (no optimizer; grads zeroed before); barrier``; a step's
time is the max over ranks. Every step also records the CPU that other processes used meanwhile; a step is clean
below ``--clean-threshold`` cores, and after a disturbed one the workers idle until the machine is quiet again.
Medians (and min/max) are over the clean steps, after warm-up steps; benchmarks/README.md has the figures.

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
import subprocess
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

from lightning_gpipe.pipe import PipelineStage, gather_events, write_chrome_trace

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


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


def torch_step(schedule: Any, stage_index: int, num_stages: int, x: torch.Tensor, y: torch.Tensor) -> float | None:
    if stage_index == num_stages - 1:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses, return_outputs=False)
        # Per-micro-batch MSE means over equal micro-batches: their mean is the full-batch MSE.
        return torch.stack([loss.detach() for loss in losses]).mean().item()
    schedule.step(x, return_outputs=False)
    return None


def machine_busy_s() -> float:
    """CPU seconds all processes on this machine have used since boot (user + nice + system + irq + softirq)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def timed(fn: Any) -> tuple[dict, Any]:
    """One step between two barriers: its wall time (max over ranks) and what else ran on the machine meanwhile.

    ``own_cores``: CPU the pipeline's processes used (all their threads, gloo's included) per second of the window;
    ``foreign_cores``: CPU that any other process used meanwhile (rank 0 reads /proc/stat). A step is ``clean``
    when ``foreign_cores`` stays under the threshold: on a shared machine, other work would otherwise be measured.
    """
    dist.barrier()
    first = dist.get_rank() == 0
    busy0, w0, c0 = machine_busy_s() if first else 0.0, time.perf_counter(), time.process_time()
    result = fn()
    dt = time.perf_counter() - w0
    dist.barrier()
    busy1, w1, c1 = machine_busy_s() if first else 0.0, time.perf_counter(), time.process_time()
    wall = torch.tensor([dt, w1 - w0 if first else 0.0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu = torch.tensor([c1 - c0, busy1 - busy0], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    step_s, window_s = float(wall[0]), float(wall[1])
    own, busy = float(cpu[0]), float(cpu[1])
    return {
        "s": step_s,
        "own_cores": own / window_s,
        "foreign_cores": max(busy - own, 0.0) / window_s,
    }, result


def pause_until_quiet(limit_s: float, threshold: float) -> float:
    """All ranks idle until the machine has been quiet for 1 s (rank 0 decides), at most ``limit_s``; returns the wait.

    The other ranks block in a broadcast meanwhile, which uses no CPU, so what rank 0 sees busy is other processes.
    """
    t0 = time.perf_counter()
    flag = torch.zeros(1)
    while True:
        if dist.get_rank() == 0:
            b0 = machine_busy_s()
            time.sleep(1.0)
            quiet = machine_busy_s() - b0 < threshold
            flag.fill_(1.0 if quiet or time.perf_counter() - t0 >= limit_s else 0.0)
        dist.broadcast(flag, src=0)
        if flag.item():
            return time.perf_counter() - t0


def measure(
    runners: dict[str, Any], zero_grad: dict[str, Any], job: dict, after_first: Any = None
) -> tuple[dict, dict, float]:
    """Warm-up, then timed steps of every runner, alternating which goes first; until each has ``steps`` clean steps
    (or ``max_steps`` timed ones). After a step that other processes disturbed, wait for the machine to be quiet
    again (at most ``wait_quiet`` seconds per configuration in all). Every rank takes the same decisions: they rest
    on all-reduced or broadcast values only."""
    records: dict[str, list[dict]] = {name: [] for name in runners}
    first_loss: dict[str, Any] = {}
    paused, disturbed = 0.0, False
    s = 0
    while True:
        if disturbed and paused < job["wait_quiet"]:
            paused += pause_until_quiet(job["wait_quiet"] - paused, job["clean_threshold"])
        disturbed = False
        names = list(runners) if s % 2 == 0 else list(reversed(runners))
        for name in names:
            zero_grad[name]()
            rec, loss = timed(runners[name])
            rec["clean"] = rec["foreign_cores"] < job["clean_threshold"]
            disturbed |= not rec["clean"]
            if s == 0:
                first_loss[name] = broadcast_from_last(loss)
            if s >= job["warmup"]:
                records[name].append(rec)
        if s == 0 and after_first is not None:
            after_first()
        s += 1
        done = s - job["warmup"]
        clean = min(sum(r["clean"] for r in recs) for recs in records.values())
        if (done >= job["steps"] and clean >= job["steps"]) or done >= job["max_steps"]:
            return records, first_loss, paused


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
    out: dict[str, Any] = {"probe_gflops": [probe()]}
    # Reference: the same model, forward + loss + backward as one batch, no engine and no re-materialization.
    plain = copy.deepcopy(model)
    records, _, paused = measure(
        {"plain": lambda: plain_step(plain, x, y)}, {"plain": lambda: plain.zero_grad(set_to_none=True)}, job
    )
    out["plain"] = {"plain": records["plain"], "paused_s": paused}
    for M in job["micro_batches"]:
        out[str(M)] = k1_config(model, x, y, M, job)
    return out


def k1_config(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, M: int, job: dict) -> dict:
    stage = PipelineStage(copy.deepcopy(model), chunks=M, balance=[LAYERS], checkpoint=job["checkpoint"])
    records, losses, paused = measure(
        {"ours": lambda: ours_step(stage, x, y)}, {"ours": lambda: stage.zero_grad(set_to_none=True)}, job
    )
    return {"ours": records["ours"], "ours_first_loss": losses["ours"], "paused_s": paused}


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
    # Each pipeline talks on its own process group, so their messages can never meet.
    groups = dist.new_group([0, 1]), dist.new_group([0, 1])
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, probe())
    out: dict[str, Any] = {"probe_gflops": gathered}
    for M in job["micro_batches"]:
        out[str(M)] = k2_config(model, x, y, M, rank, groups, job)
    return out


def k2_config(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, M: int, rank: int, groups: tuple, job: dict
) -> dict:
    ours = PipelineStage(copy.deepcopy(model), chunks=M, balance=[4, 4], checkpoint=job["checkpoint"], group=groups[0])
    schedule, torch_module = build_torch(model, rank, M, groups[1], job["torch_checkpoint"])
    grad_diff: list[float] = []

    def compare_grads() -> None:
        # After step 0 both hold the gradients of the same weights on the same batch: they should agree.
        diff = max((a - b).abs().max().item() for a, b in zip(grads(ours), grads(torch_module)))
        grad_diff.append(max_over_ranks(diff))

    records, losses, paused = measure(
        {"ours": lambda: ours_step(ours, x, y), "torch": lambda: torch_step(schedule, rank, 2, x, y)},
        {"ours": lambda: ours.zero_grad(set_to_none=True), "torch": lambda: torch_module.zero_grad(set_to_none=True)},
        job,
        after_first=compare_grads,
    )
    entry: dict[str, Any] = {
        "ours": records["ours"],
        "torch": records["torch"],
        "ours_first_loss": losses["ours"],
        "torch_first_loss": losses["torch"],
        "max_abs_grad_diff": grad_diff[0],
        "paused_s": paused,
    }
    if job["trace"] and M == job["trace_m"]:
        entry["trace"] = trace_one_step(ours, x, y, job)
    return entry


def trace_one_step(stage: PipelineStage, x: torch.Tensor, y: torch.Tensor, job: dict) -> dict:
    """One extra K=2 step with the timeline on (the first clean one of up to 5): a Chrome trace and its breakdown."""
    for _attempt in range(5):
        pause_until_quiet(job["wait_quiet"] / 4, job["clean_threshold"])
        stage.zero_grad(set_to_none=True)
        stage.timeline.clear()
        stage.timeline.enabled = True
        rec, _ = timed(lambda: ours_step(stage, x, y))
        stage.timeline.enabled = False
        if rec["foreign_cores"] < job["clean_threshold"]:
            break
    events = gather_events(stage.timeline)
    stage.timeline.clear()
    if dist.get_rank() != 0:
        return {}
    path = job["trace_path"]
    write_chrome_trace(events, path)
    steps = [e for e in events if e.kind == "step"]
    span = (max(e.end_ns for e in steps) - min(e.start_ns for e in steps)) / 1e6
    summary: dict[str, Any] = {"path": path, "span_ms": span, "step": rec, "stages": {}}
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


def engine_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when lightning_gpipe/ has uncommitted changes (what workers import)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "lightning_gpipe"], capture_output=True, text=True)
        return head + ("+dirty" if dirty.stdout.strip() else "")
    return None


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
        "engine_commit": engine_commit(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cpu_snapshot() -> dict:
    """Machine-wide busy/steal CPU seconds (/proc/stat) and this script's own CPU seconds (itself + reaped workers)."""
    import resource

    busy = steal = 0.0
    with contextlib.suppress(OSError):
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal_ticks = fields[:8]
        busy = (user + nice + system + irq + softirq) / tick
        steal = steal_ticks / tick
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return {"wall": time.perf_counter(), "busy": busy, "steal": steal, "own": own}


def foreign_load(before: dict, after: dict) -> dict:
    """CPU that other processes used while this benchmark ran, in cores (0 on a quiet machine)."""
    wall = after["wall"] - before["wall"]
    foreign = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
    return {
        "wall_s": wall,
        "own_cpu_s": after["own"] - before["own"],
        "foreign_cpu_s": foreign,
        "foreign_cores": foreign / wall if wall else None,
        "steal_cores": (after["steal"] - before["steal"]) / wall if wall else None,
    }


def probe(seconds: float = 0.6) -> float:
    """This process's single-thread matmul throughput (GFLOP/s): run alone (K=1) or on all ranks at once (K=2)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - t0) / 1e9


def wait_quiet(limit_s: float, threshold: float) -> float:
    """Wait (at most ``limit_s``) until the machine uses under ``threshold`` cores for 2 s; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        b0 = machine_busy_s()
        time.sleep(2.0)
        if (machine_busy_s() - b0) / 2.0 < threshold:
            break
    return time.perf_counter() - t0


def stats(records: list[dict]) -> dict:
    """Median/min/max over the clean steps when there are ≥ 5 of them, else over all steps (``noisy``)."""
    clean = [r for r in records if r["clean"]]
    use = clean if len(clean) >= 5 else records
    times = [r["s"] for r in use]
    med = statistics.median(times)
    return {
        "median_ms": med * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "samples_per_s": BATCH / med,
        "n": len(times),
        "clean_steps": len(clean),
        "timed_steps": len(records),
        "noisy": len(clean) < 5,
        "median_ms_all_steps": statistics.median(r["s"] for r in records) * 1e3,
        "median_own_cores": statistics.median(r["own_cores"] for r in use),
        "steps": [{**r, "ms": r["s"] * 1e3} for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="clean timed steps wanted per configuration (≥ 5)")
    parser.add_argument("--max-steps", type=int, default=20, help="timed steps at most per configuration")
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
    parser.add_argument(
        "--clean-threshold",
        type=float,
        default=0.1,
        help="a step is clean when other processes used fewer cores than this meanwhile",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=45.0,
        help="seconds at most to wait for a quiet machine before each job and, in all, within each configuration",
    )
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
    job = {
        "micro_batches": args.micro_batches,
        "steps": args.steps,
        "max_steps": max(args.max_steps, args.steps),
        "warmup": args.warmup,
        "checkpoint": args.checkpoint,
        "torch_checkpoint": args.torch_checkpoint,
        "clean_threshold": args.clean_threshold,
        "wait_quiet": args.wait_quiet,
        "trace": False,
        "trace_m": args.trace_m,
        "trace_path": str(out_path.with_name(f"engine_trace_k2_m{args.trace_m}.json")),
    }

    info = machine_info()
    print(
        f"# {info['cpu_model']}, {info['usable_cores']} usable cores, torch {info['torch']}, {info['date']}\n"
        f"# {LAYERS} x TransformerEncoderLayer(d={D_MODEL}, heads={HEADS}, ffn={FFN}), batch {BATCH}x{SEQ}, "
        f"{args.warmup} warm-up + {args.steps} clean timed steps (≤ {job['max_steps']}) x {args.rounds} round(s), "
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
            waited = wait_quiet(args.wait_quiet, args.clean_threshold) if args.wait_quiet > 0 else 0.0
            t0, commit = time.perf_counter(), engine_commit()
            raw[f"k{world}"].append(launch(world, dict(job, trace=args.trace and r == 0 and world == 2)))
            order.append(
                f"round {r}: {name}, M={args.micro_batches} ({time.perf_counter() - t0:.0f} s"
                + (f", after waiting {waited:.0f} s for a quiet machine" if waited >= 3 else "")
                + f"; engine {commit} at spawn)"
            )
            print(f"# {order[-1]}", flush=True)
    foreign = foreign_load(snap_before, cpu_snapshot())
    probes = {
        "k1_alone_gflops": [g for run in raw["k1"] for g in run["probe_gflops"]],
        "k2_concurrent_gflops_per_rank": [g for run in raw["k2"] for g in run["probe_gflops"]],
    }

    plain = stats([rec for run in raw["k1"] for rec in run["plain"]["plain"]])
    configs: list[dict] = [
        {"config": "plain K=1", "M": 1, **plain, "paused_s": sum(run["plain"]["paused_s"] for run in raw["k1"])}
    ]
    summary: list[dict] = []
    K = 2
    for M in args.micro_batches:
        key = str(M)
        k1 = stats([rec for run in raw["k1"] for rec in run[key]["ours"]])
        k2 = stats([rec for run in raw["k2"] for rec in run[key]["ours"]])
        tk = stats([rec for run in raw["k2"] for rec in run[key]["torch"]])
        paused_k1 = sum(run[key]["paused_s"] for run in raw["k1"])
        paused_k2 = sum(run[key]["paused_s"] for run in raw["k2"])
        configs += [
            {"config": "ours K=1", "M": M, **k1, "paused_s": paused_k1},
            {"config": "ours K=2", "M": M, **k2, "paused_s": paused_k2},
            {"config": "torch GPipe K=2", "M": M, **tk, "paused_s": paused_k2},
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
    traced = [run[str(args.trace_m)] for run in raw["k2"] if str(args.trace_m) in run]
    trace = next((entry["trace"] for entry in traced if "trace" in entry), None)
    if trace:
        print(
            f"\ntrace of one K=2 M={args.trace_m} step of ours: {trace['path']} (span {trace['span_ms']:.1f} ms, "
            f"other processes {trace['step']['foreign_cores']:.2f} cores meanwhile)"
        )
        for k, st in trace["stages"].items():
            kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["ms_per_kind"].items())
            units = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["median_unit_ms"].items())
            print(
                f"  stage {k}: compute {st['compute_ms']:.1f} ms = {100 * st['compute_fraction_of_span']:.0f}% of the "
                f"span; totals [ms] {kinds}; median per micro-batch [ms] {units}"
            )
    total = time.perf_counter() - t_start
    alone = statistics.median(probes["k1_alone_gflops"])
    pair = probes["k2_concurrent_gflops_per_rank"]
    print(
        f"\n# machine check: one process alone {alone:.0f} GFLOP/s (512x512 matmul, 1 thread); two at once "
        f"{' and '.join(f'{g:.0f}' for g in pair)} GFLOP/s each (parallel efficiency "
        f"{statistics.mean(pair) / alone:.2f})"
    )
    print(
        f"# other processes used {foreign['foreign_cores']:.2f} cores on average during the run (steal "
        f"{foreign['steal_cores']:.2f}); load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    commit_after = engine_commit()
    if commit_after != info["engine_commit"]:
        print(
            f"# WARNING: lightning_gpipe/ changed during the run ({info['engine_commit']} -> {commit_after}); "
            "each job's line above says what its workers imported"
        )
    print(f"# total {total:.0f} s")

    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": info,
        "engine_commit_after": commit_after,
        "machine_check": {
            **probes,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "during_run": foreign,
        },
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
            "clean_steps_wanted": args.steps,
            "max_timed_steps": job["max_steps"],
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
    out_path.write_text(json.dumps(result, indent=2))
    print(f"# wrote {out_path}")


if __name__ == "__main__":
    main()
