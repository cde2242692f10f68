"""Variable sequence lengths for benchmarks/peers.py: the timed steps, and probes of torch's schedule built once."""

# Apart from the driver because torch's schedule built once may crash or hang at a new length: it runs in its own
# forked processes, under a watchdog, and this is the machinery for that (plus the timed variable-length steps).

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks._lib import workloads as wl
from benchmarks._lib.machine import broadcast_from_last, free_port, timed, zeroed
from lightning_gpipe.pipe import GPipeStage

# The systems timed at variable lengths (plain: the reference for the losses), and the relative loss difference from
# plain that still counts as a match (peers.py reports both).
VAR_SYSTEMS = ("ours except_last", "plain", "torch GPipe rebuilt per step", "ours 1f1b (except_last)")
REL_TOL = 1e-5


def var_batch(L: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(wl.BATCH, L, wl.D_MODEL, generator=g), torch.randn(wl.BATCH, L, wl.D_MODEL, generator=g)


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(a - b) / max(abs(b), 1e-12)


def torch_rebuilt_step(module: nn.Module, rank: int, M: int, group: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """A new torch GPipeStage + ScheduleGPipe around the same stage module, then one step (shape inferred anew)."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import ScheduleGPipe

    stage = TorchStage(module, rank, 2, torch.device("cpu"), group=group)
    return wl.torch_step(ScheduleGPipe(stage, n_microbatches=M, loss_fn=F.mse_loss), rank == 1, x, y)


def variable_lengths(rank: int, model: nn.Sequential, job: dict) -> list[dict]:
    """The same layers, one step per length in turn: ours (whole-batch loss, and 1F1B via forward_backward), plain, and
    torch's stage + schedule rebuilt every step."""
    M, last, half = job["var_m"], rank == 1, wl.LAYERS // 2
    g_ours, g_torch, g_1f1b = dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group([0, 1])
    ours = GPipeStage(copy.deepcopy(model), chunks=M, balance=[half, half], group=g_ours)
    ours_1f1b = GPipeStage(copy.deepcopy(model), chunks=M, balance=[half, half], group=g_1f1b)
    plain = copy.deepcopy(model)
    tmod = wl.CheckpointedStage(list(copy.deepcopy(model))[rank * half : (rank + 1) * half], "stage")
    steps: list[dict] = []
    lengths = job["lengths"] * job["var_passes"]
    for i, L in enumerate([job["lengths"][0], *lengths]):  # step 0: untimed warm-up at the first length
        x, y = var_batch(L, i)
        runners = {
            "ours except_last": zeroed(ours, lambda x=x, y=y: wl.ours_step(ours, x, y)),
            "plain": zeroed(plain, lambda x=x, y=y: wl.plain_step(plain, x, y) if last else None),
            "torch GPipe rebuilt per step": zeroed(
                tmod, lambda x=x, y=y: torch_rebuilt_step(tmod, rank, M, g_torch, x, y)
            ),
            "ours 1f1b (except_last)": zeroed(
                ours_1f1b, lambda x=x, y=y: wl.ours_forward_backward(ours_1f1b, x, y, "1f1b")
            ),
        }
        names = list(runners) if i % 2 == 0 else list(reversed(runners))
        rec: dict[str, Any] = {"step": i - 1, "L": L, "tokens": wl.BATCH * L, "warmup": i == 0}
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
    wl.configure(spec["shape"])
    model = wl.build_encoder()
    schedule, module = wl.build_torch(model, rank, spec["M"], None, "stage")
    steps: list[dict] = []
    for i, L in enumerate(spec["lengths"]):
        x, y = var_batch(L, i)
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        try:
            loss = wl.torch_step(schedule, rank == 1, x, y)
            rec = {"step": i, "L": L, "ms": (time.perf_counter() - t0) * 1e3, "loss": loss}
            if rank == 1:
                rec["plain_loss"] = wl.plain_step(copy.deepcopy(model), x, y)
                rec["rel_diff_vs_plain"] = rel(loss, rec["plain_loss"])
        except Exception as e:  # what torch does is the result
            rec = {"step": i, "L": L, "error": f"{type(e).__name__}: {e}".strip()}
        steps.append(rec)
        path.write_text(json.dumps(steps))
        if "error" in rec:
            break
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def start_probes(
    probes: dict[str, list[int]], shape: dict, M: int, pg_timeout: float, worker: Callable[[dict], None] | None = None
) -> dict:
    """Two processes per probe (gloo timeout ``pg_timeout``), all started at once; ``collect_probes`` waits.
    ``worker`` (default :func:`probe_worker`) runs each rank: peers_hf.py passes its own model's.

    Forked, not spawned: they skip importing torch again (nothing has started a thread or a process group here)."""
    import torch.distributed.pipelining  # noqa: F401  (imported once, before the fork)

    tmp, started, ctx = Path(tempfile.mkdtemp(prefix="peers_probe_")), {}, mp.get_context("fork")
    os.environ["OMP_NUM_THREADS"] = "1"
    for i, (name, lengths) in enumerate(probes.items()):
        d = tmp / str(i)
        d.mkdir()
        spec = dict(dir=str(d), init=f"tcp://127.0.0.1:{free_port()}", shape=shape, M=M, lengths=lengths)
        spec["pg_timeout"] = pg_timeout
        ps = [ctx.Process(target=worker or probe_worker, args=({**spec, "rank": r},)) for r in (0, 1)]
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


def variable_summary(steps: list[dict], systems: tuple[str, ...] = VAR_SYSTEMS) -> list[dict]:
    """Per system: tokens/s over the clean timed steps (all of them if fewer than 5), worst loss difference; vs_plain
    against the system named "plain"."""
    timed_steps, rows = [s for s in steps if not s["warmup"]], []
    for name in systems:
        clean = [s for s in timed_steps if s[name]["clean"]]
        use = clean if len(clean) >= 5 else timed_steps
        secs, tokens = sum(s[name]["s"] for s in use), sum(s["tokens"] for s in use)
        worst = max(s[name]["rel_diff_vs_plain"] for s in timed_steps)
        rows.append({"system": name, "steps": f"{len(clean)}/{len(timed_steps)}", "tokens_per_s": tokens / secs})
        rows[-1].update(us_per_token=secs / tokens * 1e6, max_rel_diff=worst, match="yes" if worst <= REL_TOL else "NO")
    plain = next(r["tokens_per_s"] for r in rows if r["system"] == "plain")
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / plain
    return rows


def plot_peers(
    data: dict, fixed_title: str, built_once: str, what: str, hatch_torch: bool = False, ncol: int = 5
) -> Any:
    """A peers results file's figure (its JSON, loaded). Left: samples/s per system and M (``fixed_title``; torch's
    bars hatched with ``hatch_torch``); right: tokens/s at variable lengths, and a one-line note of what torch's
    schedule built once (``built_once``) did (the full errors: the JSON). ``what`` titles it."""
    from benchmarks._lib import report

    rows, var_rows, probes = data["fixed"], data["variable"], data["torch_built_once"]
    micro_batches = list(dict.fromkeys(r["M"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    colors = {name: f"C{j}" for j, name in enumerate(systems)}
    spare = iter(f"C{j}" for j in range(10) if f"C{j}" not in colors.values())
    for r in var_rows:
        if r["system"] not in colors:
            colors[r["system"]] = next(spare, "k")
    fig, axes = report.subplots(1, 2, figsize=(13, 5.4), gridspec_kw={"width_ratios": [3, 2]})
    a, b = axes[0]
    w = 0.8 / len(systems)
    for j, name in enumerate(systems):
        ys = [next(r["samples_per_s"] for r in rows if r["system"] == name and r["M"] == M) for M in micro_batches]
        xs = [i + (j - (len(systems) - 1) / 2) * w for i in range(len(micro_batches))]
        hatch = "//" if hatch_torch and name.startswith("torch") else None
        a.bar(xs, ys, w, color=colors[name], label=name, hatch=hatch)
    a.set_xticks(range(len(micro_batches)), [f"M={M}" for M in micro_batches])
    a.set(xlabel="M (micro-batches)", ylabel="throughput (samples/s, median step)")
    a.set_title(fixed_title, fontsize=10)
    fig.legend(*a.get_legend_handles_labels(), loc="outside lower center", ncol=ncol, fontsize=8)
    names = [r["system"] for r in var_rows]
    b.bar(range(len(names)), [r["tokens_per_s"] for r in var_rows], color=[colors[n] for n in names])
    failed = [p["short"] for p in probes.values()]
    labels = [n.replace(" ", "\n", 2) for n in names] + ([built_once] if failed else [])
    b.set_xticks(range(len(labels)), labels, fontsize=7)
    b.set_xlim(-0.6, len(labels) - 0.4)
    if failed:  # no bar: it did not run; why, in one line per probe
        b.text(len(names), 0, "\n".join(failed), rotation=90, ha="center", va="bottom", fontsize=7, color="C3")
    b.set(xlabel="system", ylabel="throughput (tokens/s over the clean timed steps)")
    lengths, m = data["job"]["lengths"], data["job"]["var_m"]
    b.set_title(f"a new sequence length every step ({min(lengths)}–{max(lengths)} tokens), M={m}", fontsize=10)
    return report.title(fig, what, data["environment"])
