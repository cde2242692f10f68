"""Measurement utilities the benchmarks share: the machine's state, clean-step timing, statistics, worker launch."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import json
import math
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "MIN_CLEAN",
    "Measured",
    "Runner",
    "Timing",
    "add_timing_args",
    "background_load",
    "broadcast_from_last",
    "cpu_snapshot",
    "engine_commit",
    "foreign_load",
    "free_port",
    "launch",
    "machine_info",
    "max_over_ranks",
    "measure",
    "paired_interval",
    "paired_ratio",
    "pause_until_quiet",
    "probe",
    "stats",
    "steady_heap",
    "timed",
    "wait_quiet",
    "zeroed",
]

REPO = Path(__file__).resolve().parents[2]
# glibc's malloc hands a freed block above its mmap threshold back to the system (a threshold it keeps moving) and
# trims its heap's free top, so the next step's tensors come back page by page, each page zeroed on first touch: on
# the 2-core VM up to 12 825 page faults a rank and K = 2 step (50 MB), 13-25 % of the step, and more for one schedule
# than another (benchmarks/README.md, "The heap"). jemalloc and tcmalloc keep freed memory (torch.backends.xeon.run_cpu
# preloads one); with glibc, every measuring process fixes its two thresholds (mallopt(3): M_TRIM_THRESHOLD -1,
# M_MMAP_THRESHOLD -3), unless GPIPE_BENCH_HEAP=glibc.
STEADY_HEAP = {-1: 2**31 - 1, -3: 32 << 20}  # mallopt takes a C int
HEAP_ENV = "GPIPE_BENCH_HEAP"
# Below this many clean steps, a configuration's statistics fall back to all its steps (flagged ``noisy``).
MIN_CLEAN = 5


# ------------------------------------------------------------------------------------------------- the machine
def machine_info() -> dict:
    """CPU, cores this process may use, torch and Python versions, the engine's commit and the date (UTC)."""
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
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def engine_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when lightning_gpipe/ has uncommitted changes (what workers import)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(REPO)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "lightning_gpipe"], capture_output=True, text=True)
        return head + ("+dirty" if dirty.stdout.strip() else "")
    return None


def _proc_stat() -> tuple[float, float]:
    """CPU seconds all processes used since boot: busy (user + nice + system + irq + softirq) and stolen."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _busy_s() -> float:
    try:
        return _proc_stat()[0]
    except (OSError, ValueError):
        # NaN compares false, so without /proc/stat no step counts as clean and no wait ends early.
        return float("nan")


def cpu_snapshot() -> dict:
    """Machine-wide busy/steal CPU seconds and this script's own CPU seconds (itself + reaped workers)."""
    busy = steal = 0.0
    with contextlib.suppress(OSError, ValueError):
        busy, steal = _proc_stat()
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return {"wall": time.perf_counter(), "busy": busy, "steal": steal, "own": own}


def foreign_load(before: dict, after: dict) -> dict:
    """CPU that other processes used between two ``cpu_snapshot``s, in cores (0 on a quiet machine)."""
    wall = after["wall"] - before["wall"]
    foreign = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
    return {
        "wall_s": wall,
        "own_cpu_s": after["own"] - before["own"],
        "foreign_cpu_s": foreign,
        "foreign_cores": foreign / wall if wall else None,
        "steal_cores": (after["steal"] - before["steal"]) / wall if wall else None,
    }


def background_load(before: dict, load_before: tuple[float, ...]) -> tuple[dict, str]:
    """Other processes' load since the ``cpu_snapshot`` ``before``: the JSON fields and a line to print."""
    foreign, load_after = foreign_load(before, cpu_snapshot()), os.getloadavg()
    line = (
        f"# other processes used {foreign['foreign_cores']:.2f} cores on average during the run (steal "
        f"{foreign['steal_cores']:.2f}); load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    return {"load_average_before": load_before, "load_average_after": load_after, "during_run": foreign}, line


def _quiet(window_s: float, threshold: float) -> bool:
    """Whether all processes together use under ``threshold`` cores over the next ``window_s`` seconds."""
    b0 = _busy_s()
    time.sleep(window_s)
    return (_busy_s() - b0) / window_s < threshold


def wait_quiet(limit_s: float, threshold: float) -> float:
    """Wait (at most ``limit_s``) until the machine uses under ``threshold`` cores for 2 s; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s and not _quiet(2.0, threshold):
        pass
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------- workers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_heap() -> str:
    """Fix glibc's thresholds in this process (``STEADY_HEAP``) unless ``GPIPE_BENCH_HEAP=glibc``; returns how its
    heap behaves: "steady", "glibc" (its own thresholds) or "not glibc"."""
    if os.environ.get(HEAP_ENV, "") == "glibc":
        return "glibc"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc"
    return "steady" if all(mallopt(option, value) == 1 for option, value in STEADY_HEAP.items()) else "glibc"


def launch(fn: Callable[[int, int, Any], Any], world: int, job: Any) -> Any:
    """Run ``fn(rank, world, job)`` on ``world`` fresh processes (gloo on 127.0.0.1, one thread each).

    Returns rank 0's result, through JSON. ``fn`` and ``job`` must pickle (a module-level function does).
    """
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        # A file rendezvous: a port picked free here could be taken by another process before rank 0 binds it.
        store = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(_worker, args=(fn, world, store, job, path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def _worker(rank: int, fn: Callable[[int, int, Any], Any], world: int, store: str, job: Any, path: str) -> None:
    torch.set_num_threads(1)
    steady_heap()
    dist.init_process_group(
        "gloo",
        init_method=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = fn(rank, world, job)
        if rank == 0:
            Path(path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown. A gloo worker thread may still hold the last collective's work, whose
    # tensors have Python objects; if it lets go of it while the interpreter is finalizing, taking the GIL ends the
    # thread by a forced unwind that aborts the process ("terminate called without an active exception", SIGABRT,
    # after a run that succeeded; seen in 2 of 5 fresh test runs, and in 4 of 15 launches of a two-stage step under
    # CPU and disk load, where the gdb backtrace showed ProcessGroupGloo::AsyncWork's destructor in that thread).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def broadcast_from_last(value: Any) -> Any:
    """The last rank's ``value`` on every rank (in a pipeline, the last stage is where the loss is)."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def probe(seconds: float = 0.6) -> float:
    """This process's single-thread matmul throughput (GFLOP/s), all ranks at once: do the cores run in parallel?"""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - t0) / 1e9


# ------------------------------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class Timing:
    """How ``measure`` times one configuration; every rank gets the same, so all take the same decisions."""

    steps: int  # clean timed steps wanted
    max_steps: int  # timed steps at most
    warmup: int  # untimed steps before them
    clean_threshold: float  # a step is clean when other processes used fewer cores than this meanwhile
    wait_quiet: float  # seconds at most, in all, to wait for a quiet machine after disturbed steps

    @classmethod
    def from_args(cls, parser: argparse.ArgumentParser, args: argparse.Namespace) -> Timing:
        """From the options ``add_timing_args`` added to ``parser`` (``max_steps`` is raised to ``steps``)."""
        if args.steps < MIN_CLEAN:
            parser.error(f"--steps must be ≥ {MIN_CLEAN}")
        return cls(args.steps, max(args.max_steps, args.steps), args.warmup, args.clean_threshold, args.wait_quiet)


def add_timing_args(parser: argparse.ArgumentParser) -> None:
    """The options ``Timing.from_args`` reads: --steps, --max-steps, --warmup, --clean-threshold, --wait-quiet."""
    parser.add_argument(
        "--steps", type=int, default=10, help=f"clean timed steps wanted per configuration (≥ {MIN_CLEAN})"
    )
    parser.add_argument("--max-steps", type=int, default=20, help="timed steps at most per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
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


class Runner(NamedTuple):
    reset: Callable[[], Any]  # runs before each step, untimed (e.g. zeroing the gradients)
    step: Callable[[], Any]  # the timed step; what it returns on the last rank at step 0 is kept


def zeroed(module: torch.nn.Module, step: Callable[[], Any]) -> Runner:
    """``step``, timed with ``module``'s gradients zeroed before it."""
    return Runner(lambda: module.zero_grad(set_to_none=True), step)


class Measured(NamedTuple):
    records: dict[str, list[dict]]  # per runner, one ``timed`` record per timed step, ``clean`` added
    first: dict[str, Any]  # per runner, what its first (warm-up) step returned on the last rank
    paused_s: float  # time spent waiting for a quiet machine


def timed(fn: Callable[[], Any]) -> tuple[dict, Any]:
    """One step between two barriers: its wall time (max over ranks) and what else ran on the machine meanwhile.

    ``own_cores``: CPU the ranks' processes used (all their threads, gloo's included) per second of the window;
    ``foreign_cores``: CPU that any other process used meanwhile (rank 0 reads /proc/stat). On a shared machine,
    other work would otherwise be measured. ``page_faults``: the minor page faults of the rank with the most (pages
    the heap took back from the system: ``STEADY_HEAP``).
    """
    dist.barrier()
    first = dist.get_rank() == 0
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    busy0, w0, c0 = _busy_s() if first else 0.0, time.perf_counter(), time.process_time()
    result = fn()
    dt = time.perf_counter() - w0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    dist.barrier()
    busy1, w1, c1 = _busy_s() if first else 0.0, time.perf_counter(), time.process_time()
    wall = torch.tensor([dt, w1 - w0 if first else 0.0, faults], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu = torch.tensor([c1 - c0, busy1 - busy0], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    step_s, window_s = float(wall[0]), float(wall[1])
    own, busy = float(cpu[0]), float(cpu[1])
    return {
        "s": step_s,
        "own_cores": own / window_s,
        "foreign_cores": max(busy - own, 0.0) / window_s,
        "page_faults": float(wall[2]),
    }, result


def pause_until_quiet(limit_s: float, threshold: float) -> float:
    """All ranks idle until the machine has been quiet for 1 s (rank 0 decides), at most ``limit_s``; returns the wait.

    The other ranks block in a broadcast meanwhile, which uses no CPU, so what rank 0 sees busy is other processes.
    """
    t0 = time.perf_counter()
    flag = torch.zeros(1)
    while True:
        if dist.get_rank() == 0:
            quiet = _quiet(1.0, threshold)
            flag.fill_(1.0 if quiet or time.perf_counter() - t0 >= limit_s else 0.0)
        dist.broadcast(flag, src=0)
        if flag.item():
            return time.perf_counter() - t0


def measure(runners: Mapping[str, Runner], timing: Timing, after_first: Callable[[], Any] | None = None) -> Measured:
    """Warm-up, then timed steps of every runner, alternating which goes first, until each has ``timing.steps`` clean
    steps (or ``timing.max_steps`` timed ones). ``after_first`` runs once, after every runner's first step.

    After a step that other processes disturbed, wait for the machine to be quiet again (at most
    ``timing.wait_quiet`` seconds in all). Every rank takes the same decisions: they rest on all-reduced or
    broadcast values only.
    """
    records: dict[str, list[dict]] = {name: [] for name in runners}
    first: dict[str, Any] = {}
    paused, disturbed = 0.0, False
    s = 0
    while True:
        if disturbed and paused < timing.wait_quiet:
            paused += pause_until_quiet(timing.wait_quiet - paused, timing.clean_threshold)
        disturbed = False
        names = list(runners) if s % 2 == 0 else list(reversed(runners))
        for name in names:
            runners[name].reset()
            rec, result = timed(runners[name].step)
            rec["clean"] = rec["foreign_cores"] < timing.clean_threshold
            disturbed |= not rec["clean"]
            if s == 0:
                first[name] = broadcast_from_last(result)
            if s >= timing.warmup:
                records[name].append(rec)
        if s == 0 and after_first is not None:
            after_first()
        s += 1
        done = s - timing.warmup
        clean = min(sum(r["clean"] for r in recs) for recs in records.values())
        if (done >= timing.steps and clean >= timing.steps) or done >= timing.max_steps:
            return Measured(records, first, paused)


def _clean_ratios(a: list[dict], b: list[dict], key: str) -> list[float]:
    return [x[key] / y[key] for x, y in zip(a, b) if x["clean"] and y["clean"]]


def paired_ratio(a: list[dict], b: list[dict], key: str = "s") -> float | None:
    """The median over rounds of a's step ÷ b's of the same round (``key``: the step's time), both clean (None: under
    3 such rounds). The two ran back to back in the same processes, so a round's ratio cancels the VM's drift, which
    moves whole steps by 10–20 % over a run: the medians of each one's own steps cannot resolve a few % between them."""
    ratios = _clean_ratios(a, b, key)
    return statistics.median(ratios) if len(ratios) >= 3 else None


def paired_interval(a: list[dict], b: list[dict], key: str = "s") -> tuple[float, float] | None:
    """A 95 % confidence interval for ``paired_ratio``'s median, free of any assumed distribution: the order statistics
    of the n clean rounds' ratios whose ranks the binomial(n, ½) puts 1.96 σ from the middle (None: under 9 rounds,
    where the interval would be the whole range). Whether a median of 1.02 tells two schedules apart or not."""
    ratios = sorted(_clean_ratios(a, b, key))
    n = len(ratios)
    if n < 9:
        return None
    half = 0.98 * math.sqrt(n)  # 1.96 σ of the binomial's count, σ = √n / 2
    lo, hi = math.floor(n / 2 - half), math.ceil(1 + n / 2 + half)  # ranks from 1, rounded outwards
    return ratios[max(lo, 1) - 1], ratios[min(hi, n) - 1]


def stats(records: list[dict], samples_per_step: int) -> dict:
    """Median/min/max over the clean steps when there are ≥ ``MIN_CLEAN``, else over all steps (``noisy``)."""
    clean = [r for r in records if r["clean"]]
    use = clean if len(clean) >= MIN_CLEAN else records
    times = [r["s"] for r in use]
    med = statistics.median(times)
    return {
        "median_ms": med * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "samples_per_s": samples_per_step / med,
        "n": len(times),
        "clean_steps": len(clean),
        "timed_steps": len(records),
        "noisy": len(clean) < MIN_CLEAN,
        "median_ms_all_steps": statistics.median(r["s"] for r in records) * 1e3,
        "median_own_cores": statistics.median(r["own_cores"] for r in use),
        "steps": [{**r, "ms": r["s"] * 1e3} for r in records],
    }


def quiet_trainer(devices: int, strategy: Any, max_steps: int, callbacks: list[Any], root: str, **extra: Any) -> Any:
    """A CPU ``Trainer`` for a timed fit: training steps only (no validation, checkpoints, logger, progress bar or
    summary), ``extra`` passed on."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
        **extra,
    )
