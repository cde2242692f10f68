"""Ours vs torch.distributed.pipelining ScheduleGPipe vs one plain process, at fixed and variable sequence lengths."""

# Run it from the repo root: python benchmarks/peers.py (--smoke: a small model, about half a minute).

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import engine_speed as es  # puts the repo root on sys.path, so lightning_gpipe imports from this checkout
import report
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import (
    Timing,
    add_timing_args,
    background_load,
    broadcast_from_last,
    cpu_snapshot,
    free_port,
    launch,
    max_over_ranks,
    measure,
    probe,
    stats,
    timed,
    wait_quiet,
)
from torch import nn

from lightning_gpipe.pipe import PipelineStage

# engine_speed's model and batch sizes (its module globals), and a small one for --smoke.
FULL = {k: getattr(es, k) for k in ("LAYERS", "D_MODEL", "HEADS", "FFN", "BATCH", "SEQ")}
SMOKE = {"LAYERS": 4, "D_MODEL": 64, "HEADS": 4, "FFN": 256, "BATCH": 16, "SEQ": 16}
LENGTHS, SMOKE_LENGTHS = [16, 32, 24, 40, 8, 48, 32, 16, 56, 24], [8, 16, 4, 12]
SYSTEMS = ("ours except_last", "ours always", "torch GPipe", "plain")
VAR_SYSTEMS = ("ours except_last", "plain", "torch GPipe rebuilt per step")
REL_TOL = 1e-5
RATIOS = {  # ratio of throughputs: (numerator system, denominator system)
    "ours_torch": ("ours except_last", "torch GPipe"),
    "always_torch": ("ours always", "torch GPipe"),
    "ours_plain": ("ours except_last", "plain"),
    "torch_plain": ("torch GPipe", "plain"),
}
FIXED_COLS = (
    "system|system|; M|M|; median_ms|median ms|.1f; min_ms|min|.1f; max_ms|max|.1f; samples_per_s|samples/s|.1f; "
    "clean|clean/timed|; over_plain|speed-up over plain|.2f"
)
RATIO_COLS = (
    "M|M|; ours_torch|ours / torch throughput|.2f; always_torch|ours always / torch|.2f; ours_plain|ours / plain|.2f; "
    "torch_plain|torch / plain|.2f; ideal|ideal 2M/(M+1)|.2f"
)
VAR_COLS = (
    "system|system|; steps|clean/timed steps|; tokens_per_s|tokens/s|.0f; us_per_token|µs/token|.1f; "
    "vs_plain|vs plain|.2f; max_rel_diff|max rel. loss diff vs plain|.1e; match|≤ {tol:g}|"
)
STEP_COLS = "step|step|; L|length|; " + "; ".join(f"{n}|{n} ms|.1f" for n in VAR_SYSTEMS)
STEP_COLS += "; loss|plain loss|.6f; diff|ours rel. diff|.1e"


def configure(shape: dict) -> None:
    """Set engine_speed's model and batch sizes, which its build_model / make_batch / build_torch read."""
    for k, v in shape.items():
        setattr(es, k, v)


def var_batch(L: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(es.BATCH, L, es.D_MODEL, generator=g), torch.randn(es.BATCH, L, es.D_MODEL, generator=g)


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(a - b) / max(abs(b), 1e-12)


def torch_rebuilt_step(module: nn.Module, rank: int, M: int, group: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """A new torch PipelineStage + ScheduleGPipe around the same stage module, then one step (shape inferred anew)."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleGPipe

    stage = TorchStage(module, rank, 2, torch.device("cpu"), group=group)
    return es.torch_step(ScheduleGPipe(stage, n_microbatches=M, loss_fn=F.mse_loss), rank == 1, x, y)


# ------------------------------------------------------------------------------------ the main job (2 processes)
def run_job(rank: int, world: int, job: dict) -> dict:
    configure(job["shape"])
    model, (x, y) = es.build_model(), es.make_batch()
    last, half = rank == 1, es.LAYERS // 2
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, probe())
    # Reference gradients of this rank's layers: the whole model on the whole batch, computed once.
    ref = copy.deepcopy(model)
    es.plain_step(ref, x, y)
    ref_grads = [p.grad for p in nn.Sequential(*list(ref)[rank * half : (rank + 1) * half]).parameters()]
    plain = copy.deepcopy(model)  # runs on the last rank only; rank 0 waits in the step's closing barrier
    out: dict[str, Any] = {"probe_gflops": gathered, "fixed": {}}
    for M in job["micro_batches"]:
        groups = [dist.new_group([0, 1]) for _ in range(3)]  # each pipeline on its own group
        ours = {
            mode: PipelineStage(copy.deepcopy(model), chunks=M, balance=[half, half], checkpoint=mode, group=g)
            for mode, g in zip(("except_last", "always"), groups)
        }
        schedule, tmod = es.build_torch(model, rank, M, groups[2], "stage")
        modules = {"ours except_last": ours["except_last"], "ours always": ours["always"], "torch GPipe": tmod}
        runners = {
            "ours except_last": es.zeroed(ours["except_last"], lambda s=ours["except_last"]: es.ours_step(s, x, y)),
            "ours always": es.zeroed(ours["always"], lambda s=ours["always"]: es.ours_step(s, x, y)),
            "torch GPipe": es.zeroed(tmod, lambda s=schedule: es.torch_step(s, last, x, y)),
            "plain": es.zeroed(plain, lambda: es.plain_step(plain, x, y) if last else None),
        }
        grad_diff: dict[str, float] = {}

        def compare(modules: dict = modules, grad_diff: dict = grad_diff) -> None:
            for name, mod in modules.items():
                d = max((g - r).abs().max().item() for g, r in zip(es.grads(mod), ref_grads))
                grad_diff[name] = max_over_ranks(d)

        m = measure(runners, job["timing"], after_first=compare)
        out["fixed"][str(M)] = dict(records=m.records, first_loss=m.first, grad_diff=grad_diff, paused_s=m.paused_s)
    out["variable"] = variable_lengths(rank, model, job)
    return out


def variable_lengths(rank: int, model: nn.Sequential, job: dict) -> list[dict]:
    """The same layers, one step per length in turn: ours, plain, and torch's stage + schedule rebuilt every step."""
    M, last, half = job["var_m"], rank == 1, es.LAYERS // 2
    g_ours, g_torch = dist.new_group([0, 1]), dist.new_group([0, 1])
    ours = PipelineStage(copy.deepcopy(model), chunks=M, balance=[half, half], group=g_ours)
    plain = copy.deepcopy(model)
    tmod = es.CheckpointedStage(list(copy.deepcopy(model))[rank * half : (rank + 1) * half], "stage")
    steps: list[dict] = []
    lengths = job["lengths"] * job["var_passes"]
    for i, L in enumerate([job["lengths"][0], *lengths]):  # step 0: untimed warm-up at the first length
        x, y = var_batch(L, i)
        runners = {
            "ours except_last": es.zeroed(ours, lambda x=x, y=y: es.ours_step(ours, x, y)),
            "plain": es.zeroed(plain, lambda x=x, y=y: es.plain_step(plain, x, y) if last else None),
            "torch GPipe rebuilt per step": es.zeroed(
                tmod, lambda x=x, y=y: torch_rebuilt_step(tmod, rank, M, g_torch, x, y)
            ),
        }
        names = list(runners) if i % 2 == 0 else list(reversed(runners))
        rec: dict[str, Any] = {"step": i - 1, "L": L, "tokens": es.BATCH * L, "warmup": i == 0}
        for name in names:
            runners[name].reset()
            t, result = timed(runners[name].step)
            rec[name] = {**t, "ms": t["s"] * 1e3, "clean": t["foreign_cores"] < job["timing"].clean_threshold}
            rec[name]["loss"] = broadcast_from_last(result)
        for name in VAR_SYSTEMS:
            rec[name]["rel_diff_vs_plain"] = rel(rec[name]["loss"], rec["plain"]["loss"])
        steps.append(rec)
    return steps


# ------------------------------------------- torch's schedule built once, fed new lengths (own processes, watchdog)
def probe_worker(spec: dict) -> None:
    """One rank of a probe: torch's ScheduleGPipe built for the first length, stepped at each length in turn.

    What each step did goes to rank<k>.json after every step, so a crash or a hang leaves the steps before it."""
    rank, path = spec["rank"], Path(spec["dir"]) / f"rank{spec['rank']}.json"
    fd = os.open(Path(spec["dir"]) / f"out{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)  # gloo's C++ abort message goes to stderr: keep it
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=spec["pg_timeout"])
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=2, timeout=timeout)
    configure(spec["shape"])
    model = es.build_model()
    schedule, module = es.build_torch(model, rank, spec["M"], None, "stage")
    steps: list[dict] = []
    for i, L in enumerate(spec["lengths"]):
        x, y = var_batch(L, i)
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        try:
            loss = es.torch_step(schedule, rank == 1, x, y)
            rec = {"step": i, "L": L, "ms": (time.perf_counter() - t0) * 1e3, "loss": loss}
            if rank == 1:
                rec["plain_loss"] = es.plain_step(copy.deepcopy(model), x, y)
                rec["rel_diff_vs_plain"] = rel(loss, rec["plain_loss"])
        except Exception as e:  # what torch does is the result
            rec = {"step": i, "L": L, "error": f"{type(e).__name__}: {e}".strip()}
        steps.append(rec)
        path.write_text(json.dumps(steps))
        if "error" in rec:
            break
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def start_probes(probes: dict[str, list[int]], shape: dict, M: int, pg_timeout: float) -> dict:
    """Two processes per probe (gloo timeout ``pg_timeout``), all started at once; ``collect_probes`` waits.

    Forked, not spawned: they skip importing torch again (nothing has started a thread or a process group here)."""
    import torch.distributed.pipelining  # noqa: F401  (imported once, before the fork)

    tmp, started, ctx = Path(tempfile.mkdtemp(prefix="peers_probe_")), {}, mp.get_context("fork")
    os.environ["OMP_NUM_THREADS"] = "1"
    for i, (name, lengths) in enumerate(probes.items()):
        d = tmp / str(i)
        d.mkdir()
        spec = dict(dir=str(d), init=f"tcp://127.0.0.1:{free_port()}", shape=shape, M=M, lengths=lengths)
        spec["pg_timeout"] = pg_timeout
        ps = [ctx.Process(target=probe_worker, args=({**spec, "rank": r},)) for r in (0, 1)]
        for p in ps:
            p.start()
        started[name] = {"dir": d, "lengths": lengths, "procs": ps}
    return {"tmp": tmp, "probes": started, "t0": time.perf_counter()}


def collect_probes(handle: dict, limit: float) -> dict:
    """What every probe did; a process still running ``limit`` s after the start hangs, and is killed."""
    result: dict[str, Any] = {}
    for name, pr in handle["probes"].items():
        ranks = []
        for r, p in enumerate(pr["procs"]):
            p.join(timeout=max(handle["t0"] + limit - time.perf_counter(), 0.1))
            if p.exitcode is None:
                p.kill()
                p.join()
                exit_ = f"hangs: still running {limit:.0f} s after the start, killed"
            else:
                exit_ = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit {p.exitcode}"
            f, log = pr["dir"] / f"rank{r}.json", (pr["dir"] / f"out{r}.txt").read_text(errors="replace")
            # A C++ exception in gloo's thread ends the process: "terminate called after throwing an instance of
            # 'T'" then "  what():  message" on stderr.
            kind = re.search(r"throwing an instance of '([^']+)'", log)
            what = re.search(r"what\(\):\s*(.+)", log)
            abort = f"{kind.group(1) if kind else 'C++ exception'}: {what.group(1).strip()}" if what else None
            steps = json.loads(f.read_text()) if f.exists() else []
            ranks.append({"rank": r, "exit": exit_, "steps": steps, "abort": abort, "log_tail": log.splitlines()[-8:]})
        long, short = verdict(pr["lengths"], ranks)
        result[name] = {"lengths": pr["lengths"], "ranks": ranks, "verdict": long, "short": short}
    shutil.rmtree(handle["tmp"], ignore_errors=True)
    return result


def verdict(lengths: list[int], ranks: list[dict]) -> tuple[str, str]:
    """All lengths ran (and were the losses right?), or where it failed and how, the cause first; long and short."""
    done = min(len([s for s in r["steps"] if "error" not in s]) for r in ranks)
    if done == len(lengths) and all(r["exit"] == "exit 0" for r in ranks):
        worst = max(s["rel_diff_vs_plain"] for s in ranks[1]["steps"])
        line = f"ran all {len(lengths)} lengths; losses {'right' if worst <= REL_TOL else 'WRONG'}"
        return f"{line} (max rel. diff vs plain {worst:.1e})", line
    parts = []
    for r in ranks:
        what = (r["abort"] or next((s["error"] for s in r["steps"] if "error" in s), "")).split(" This is typically")[0]
        short = r["exit"] if r["exit"] != "exit 0" else what.split(":")[0]
        parts.append(
            (
                " by peer" in what,
                f"rank {r['rank']} {r['exit']}" + f": {what}" * bool(what),
                f"rank {r['rank']} {short}",
            )
        )
    where = f"fails at step {done} (length {lengths[done - 1]} → {lengths[done]})" if done else "fails at step 0"
    parts.sort()
    return f"{where}: " + "; ".join(p[1] for p in parts), f"{where}: {parts[0][2]}"


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
        st = {name: stats(entry["records"][name], es.BATCH) for name in SYSTEMS}
        med = {name: st[name]["median_ms"] for name in SYSTEMS}
        for name in SYSTEMS:
            clean, grad = f"{st[name]['clean_steps']}/{st[name]['timed_steps']}", entry["grad_diff"]
            rows.append({"system": name, "M": M, **st[name], "clean": clean, "over_plain": med["plain"] / med[name]})
            rows[-1].update(first_loss=entry["first_loss"][name], grad_diff=grad.get(name, 0.0))
        ratios.append({"M": M, "ideal": 2 * M / (M + 1), **{k: med[b] / med[a] for k, (a, b) in RATIOS.items()}})
    return rows, ratios


def variable_summary(steps: list[dict]) -> list[dict]:
    """Per system: tokens/s over the clean timed steps (all of them if fewer than 5), worst loss difference."""
    timed_steps, rows = [s for s in steps if not s["warmup"]], []
    for name in VAR_SYSTEMS:
        clean = [s for s in timed_steps if s[name]["clean"]]
        use = clean if len(clean) >= 5 else timed_steps
        secs, tokens = sum(s[name]["s"] for s in use), sum(s["tokens"] for s in use)
        worst = max(s[name]["rel_diff_vs_plain"] for s in timed_steps)
        rows.append({"system": name, "steps": f"{len(clean)}/{len(timed_steps)}", "tokens_per_s": tokens / secs})
        rows[-1].update(us_per_token=secs / tokens * 1e6, max_rel_diff=worst, match="yes" if worst <= REL_TOL else "NO")
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / rows[1]["tokens_per_s"]
    return rows


def figure(rows: list[dict], micro_batches: list[int], var_rows: list[dict], probes: dict) -> Any:
    """Left: samples/s per system and M; right: tokens/s at variable lengths, and what torch's built-once did."""
    plt = report.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    w = 0.8 / len(SYSTEMS)
    for j, name in enumerate(SYSTEMS):
        ys = [next(r["samples_per_s"] for r in rows if r["system"] == name and r["M"] == M) for M in micro_batches]
        a.bar([i + (j - 1.5) * w for i in range(len(micro_batches))], ys, w, label=name)
    a.set_xticks(range(len(micro_batches)), [f"M={M}" for M in micro_batches])
    a.set(ylabel="samples/s (median step)", title=f"fixed shape, K=2, {es.LAYERS} layers, batch {es.BATCH}×{es.SEQ}")
    a.legend(fontsize=8)
    names = [r["system"].replace(" ", "\n", 2) for r in var_rows] + ["torch GPipe\nbuilt once"]
    b.bar(range(len(names)), [r["tokens_per_s"] for r in var_rows] + [0.0], color=["C0", "C3", "C2", "C7"])
    b.set_xticks(range(len(names)), names, fontsize=7)
    b.set(ylabel="tokens/s", title="variable sequence length per step")
    short = "\n".join(p["short"] for p in probes.values())
    b.text(len(names) - 1, 0, short, rotation=90, ha="center", va="bottom", fontsize=7, color="C3")
    text = "\n".join(textwrap.fill(f"torch GPipe built once, {k}: {p['verdict']}", 190) for k, p in probes.items())
    text = re.sub("[\U00010000-\U0010ffff\ufe0f]", "", text)  # no emoji in the plot's font
    fig.text(0.01, 0.0, text, va="top", fontsize=7, color="C3")
    fig.tight_layout()
    return fig


def table(rows: list[dict], spec: str) -> str:
    """report.markdown_table with its columns given as "key|header|format; ..."."""
    return report.markdown_table(rows, [tuple(c.strip().split("|")) for c in spec.split(";")])  # type: ignore[misc]


def markdown(env: dict, args: argparse.Namespace, raw: dict, tables: tuple, probes: dict, extra: str) -> str:
    rows, ratios, var_rows = tables
    per_step = [{"step": s["step"], "L": s["L"], **{n: s[n]["ms"] for n in VAR_SYSTEMS}} for s in raw["variable"]]
    for rec, s in zip(per_step, raw["variable"]):
        rec.update(loss=s["plain"]["loss"], diff=s["ours except_last"]["rel_diff_vs_plain"])
    sanity = "; ".join(f"M={r['M']} {r['system']} {r['first_loss']:.6f} ({r['grad_diff']:.1e})" for r in rows)
    model = (
        f"Model: {es.LAYERS} × TransformerEncoderLayer(d={es.D_MODEL}, heads={es.HEADS}, ffn={es.FFN}, dropout 0), "
        f"MSE loss; K=2 stages of {es.LAYERS // 2} layers. torch's stage runs its layers under one "
        "`torch.utils.checkpoint` (every micro-batch recomputed); ours `except_last` keeps the last micro-batch's "
        "graph, `always` recomputes all. `plain` = the whole model on the whole batch in one process (rank 1, while "
        "rank 0 waits), no recomputation. The four alternate step by step in the same two processes; a step = "
        f"forward + loss + backward between barriers; medians of clean steps after {args.warmup} warm-up."
    )
    var = f"{args.lengths} × {args.var_passes} pass(es), batch {es.BATCH}, M={args.micro_batches[0]}"
    probe_lines = []
    for name, p in probes.items():
        probe_lines.append(f"- **{name}** {p['lengths']}: {p['verdict']}")
        for r in p["ranks"]:
            steps = ", ".join(f"L={s['L']} " + (f"`{s['error']}`" if "error" in s else "ok") for s in r["steps"])
            probe_lines.append(
                f"  - rank {r['rank']}: {r['exit']}; steps {steps}" + f"; `{r['abort']}`" * bool(r["abort"])
            )
    blocks = [
        "# Peers: ours vs torch.distributed.pipelining ScheduleGPipe vs plain",
        "\n".join([*report.environment_lines(env), extra]),
        model,
        f"## Fixed shape (batch {es.BATCH} × {es.SEQ})",
        table(rows, FIXED_COLS),
        table(ratios, RATIO_COLS),
        f"First-step loss (max abs. gradient difference from plain's), same weights and batch: {sanity}",
        f"## Variable sequence length: {var}",
        "`torch GPipe rebuilt per step`: a new torch `PipelineStage` + `ScheduleGPipe` around the same stage module "
        "every step; its time includes the build and torch's runtime shape inference. Step -1 is the warm-up.",
        table(var_rows, VAR_COLS.format(tol=REL_TOL)),
        table(per_step, STEP_COLS),
        "### torch's ScheduleGPipe built once (first length), then fed the next lengths",
        "\n".join(probe_lines),
        f"Command: `{' '.join(['python', *sys.argv])}`",
    ]
    return "\n\n".join(blocks)


def main() -> None:
    args, timing = parse_args()
    shape = SMOKE if args.smoke else FULL
    configure(shape)
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
    data = dict(command=" ".join(["python", *sys.argv]), environment=env, job={**job, "timing": vars(timing)})
    data.update(machine_check={"probe_gflops": gf, **background}, fixed=rows, ratios=ratios, variable=var_rows)
    data.update(variable_steps=raw["variable"], torch_built_once=probes, raw_fixed=raw["fixed"], total_s=total)
    paths = report.write("peers", data, md, figure(rows, args.micro_batches, var_rows, probes), args.out_dir)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
