"""1F1B, ZB-H1 and interleaved 1F1B vs GPipe, the loss per micro-batch: peak activation per stage, step time."""

# Run through memory.py: python -m benchmarks.memory --schedules (its --models, --chunks, --device, --smoke,
# --out-dir apply; --ks picks K). The models, batches, balance and meters are memory.py's (memory_models.py,
# memory_probe.py); METHOD says the rest.

from __future__ import annotations

import argparse
import copy
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._lib import report
from benchmarks._lib.machine import Timing, launch, measure, stats, wait_quiet, zeroed
from benchmarks._lib.memory_models import build, layer_costs, loss_fn
from benchmarks._lib.memory_probe import Meter, state_bytes
from benchmarks._lib.workloads import per_micro_batch
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.schedule.registry import lookup
from lightning_gpipe.pipe.schedule.simulator import simulate

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "zb-h1": "ZB-H1", "interleaved-1f1b": "interleaved 1F1B", "zb-v": "ZB-V"}
V = 2  # virtual stages per rank under "interleaved-1f1b" (its own stage: the same costs solved for 2K parts)
MB = 2**20
METHOD = """\
**Method.** One process per stage, one thread each, gloo on 127.0.0.1; `GPipeStage(checkpoint="never")` (every
micro-batch keeps its activations from its forward to its backward), the same layers per stage for every schedule
(memory.py's balance), M micro-batches of equal size; one step = `stage.forward_backward(x, loss_fn, schedule=...)` (the
loss per micro-batch on the last stage, weighted n_m/N) + Adam. After a warm-up step on one micro-batch, each
schedule's step is measured once, in the same processes: *peak activation* = the peak of the tensor storages
allocated during the step (memory.py's exact count, a `TorchDispatchMode`; on CUDA `max_memory_allocated`), i.e.
activations, temporaries, received tensors and gradients in flight, not the model's state. A stage holds at most
min(M, K − k) micro-batches under 1F1B and M under GPipe (1 on GPipe's last stage, which runs F m B m by turns), so
stage 0's ratio 1F1B / GPipe should be about K/M; the target is ≤ 1.25 · K/M. ZB-H1 holds min(M, K) on every stage
(rank k defers its weight gradients by k backwards; between I and W a micro-batch keeps only what W needs: the inputs
and output gradients of its linear, convolution and embedding ops). Interleaved 1F1B runs on a stage of its own,
v = 2 virtual stages per rank (the same layer costs solved for 2K parts: rank k holds chunks k and k + K); its in-flight
count is the simulator's peak of chunk micro-batches over v (in stages' worth). ZB-V runs on a third stage, two chunks
per rank in a V (rank k holds chunks k and 2K − 1 − k), its in-flight count counted alike. Step time: then the schedules
alternate step by step in the same processes, without the meter (medians of clean steps, `machine.measure`)."""


def run(rank: int, world: int, job: dict) -> dict:
    """One model at one K: each schedule's peak activation per stage, then the schedules' step times."""
    torch.set_num_threads(1)
    spec, M, cuda = job["spec"], job["M"], job["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if cuda and world > 1 else None
    model, x, target = build(job["model"], spec, spec["size"])
    interleaved_model, v_model = copy.deepcopy(model), copy.deepcopy(model)
    costs = layer_costs(model, x, max(2, spec["N"] // M), spec["N"]) if world > 1 and rank == 0 else None
    balance: Any = [len(model)] if world == 1 else (lambda i, _layer: costs[i])
    stage = GPipeStage(model, chunks=M, balance=balance, checkpoint="never", group=group, device=device)
    interleaved = GPipeStage(
        interleaved_model, chunks=M, balance=balance, checkpoint="never", group=group, device=device, virtual_stages=V
    )
    in_v = GPipeStage(
        v_model,
        chunks=M,
        balance=balance,
        checkpoint="never",
        group=group,
        device=device,
        virtual_stages=V,
        placement="v",
    )
    del model, interleaved_model, v_model
    for st in (stage, interleaved, in_v):
        st.to(device)
    x = tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
    target = target.to(device)
    opts = {s: torch.optim.Adam(s.parameters(), lr=1e-4, foreach=False) for s in (stage, interleaved, in_v)}

    def on(schedule: str) -> GPipeStage:
        return {"interleaved-1f1b": interleaved, "zb-v": in_v}.get(schedule, stage)

    def step(schedule: str, inputs: Any, tgt: torch.Tensor) -> None:
        st = on(schedule)
        per_micro = per_micro_batch(loss_fn, tgt, st.micro_batch_sizes(inputs))
        st.forward_backward(inputs if st.is_first else None, per_micro, schedule=schedule)  # type: ignore[arg-type]
        opts[st].step()

    n = spec["N"] // M  # warm-up on one micro-batch of the measured shape (see memory.py)
    stage._chunks = 1  # private; stage 0 splits by it, the other stages follow the header
    step("gpipe", tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n], target[:n])
    stage._chunks = M
    step("interleaved-1f1b", x, target)  # its warm-up: interleaving needs M ≥ K micro-batches
    step("zb-v", x, target)
    peaks: dict[str, dict] = {}
    for schedule in job["order"]:
        opts[on(schedule)].zero_grad(set_to_none=False)
        gc.collect()
        if world > 1:
            dist.barrier()
        meter = Meter(device)
        with meter.window():
            step(schedule, x, target)
        peaks[schedule] = {"peak_activation_bytes": meter.peak(), "rss_peak_bytes": meter.rss_peak()}
    runners = {s: zeroed(on(s), lambda s=s: step(s, x, target)) for s in SCHEDULES}
    timing = measure(runners, Timing(**job["timing"]))
    row = {
        "stage": rank,
        "layers": len(list(stage.children())),
        "model_bytes": state_bytes(stage, opts[stage]),
        **peaks,
    }
    rows: list[Any] = [row] * world
    if world > 1:
        dist.all_gather_object(rows, row)
    return {"stages": rows, "timing": timing.records}


def in_flight(schedule: str, k: int, K: int, M: int) -> float:
    """Micro-batches whose activations stage k holds at once under ``schedule`` (interleaved: in stages' worth)."""
    if schedule in ("interleaved-1f1b", "zb-v"):
        placement = lookup(schedule).placement
        return simulate(lookup(schedule).actions(K, M, V), K, V, placement=placement).peak[k] / V
    if schedule == "1f1b":
        return min(M, K - k)
    if schedule == "zb-h1":
        return min(M, K)
    return 1 if k == K - 1 else M


def compare(args: argparse.Namespace, families: dict, ks: list[int]) -> None:
    """The runs (fresh processes per model and K), then the tables, the JSON and the figure."""
    t0, M = time.perf_counter(), args.chunks
    runs: list[dict] = []
    timing = dict(steps=3 if args.smoke else 6, max_steps=3 if args.smoke else 10, warmup=1)
    timing |= dict(clean_threshold=0.1, wait_quiet=0.0 if args.smoke else 20.0)
    for name in args.models:
        for i, K in enumerate(ks):
            wait_quiet(timing["wait_quiet"], timing["clean_threshold"])
            order = list(SCHEDULES) if i % 2 == 0 else list(SCHEDULES)[::-1]
            job = dict(model=name, spec=families[name], M=M, device=args.device, order=order, timing=timing)
            res = launch(run, K, job)
            runs.append({"model": name, "K": K, "M": M, **res})
            print(f"  {name} K={K}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows, time_rows, cores = [], [], report.environment()["usable_cores"]
    for r in runs:
        K = r["K"]
        for st in r["stages"]:
            k, peak = st["stage"], {s: st[s]["peak_activation_bytes"] for s in SCHEDULES}
            ideal = in_flight("1f1b", k, K, M) / in_flight("gpipe", k, K, M)
            ratio = peak["1f1b"] / peak["gpipe"] if peak["gpipe"] else None
            row = {"model": r["model"], "K": K, "stage": k, "layers": st["layers"], "model_mb": st["model_bytes"] / MB}
            row |= {f"{s}_mb": peak[s] / MB for s in SCHEDULES}
            row |= {f"{s}_inflight": in_flight(s, k, K, M) for s in SCHEDULES}
            row |= {"ratio": ratio, "ideal": ideal, "bound": 1.25 * K / M}
            row["met"] = "–" if k else ("yes" if ratio is not None and ratio <= 1.25 * K / M else "NO")
            rows.append(row)
        worst = {s: max(st[s]["peak_activation_bytes"] for st in r["stages"]) for s in SCHEDULES}
        st_ = {s: stats(r["timing"][s], families[r["model"]]["N"]) for s in SCHEDULES}
        trow = {"model": r["model"], "K": K, "M": M, **{f"{s}_ms": st_[s]["median_ms"] for s in SCHEDULES}}
        trow |= {"time_ratio": st_["1f1b"]["median_ms"] / st_["gpipe"]["median_ms"]}
        trow |= {"zb_time_ratio": st_["zb-h1"]["median_ms"] / st_["1f1b"]["median_ms"]}
        trow |= {"il_time_ratio": st_["interleaved-1f1b"]["median_ms"] / st_["1f1b"]["median_ms"]}
        trow |= {"zbv_time_ratio": st_["zb-v"]["median_ms"] / st_["1f1b"]["median_ms"]}
        trow |= {f"{s}_worst_vs_1f1b": worst[s] / worst["1f1b"] for s in ("zb-h1", "interleaved-1f1b", "zb-v")}
        trow |= {"worst_ratio": worst["1f1b"] / worst["gpipe"], "clean": f"{st_['gpipe']['clean_steps']}/"}
        trow["clean"] += f"{st_['1f1b']['clean_steps']}/{st_['zb-h1']['clean_steps']} of {st_['gpipe']['timed_steps']}"
        notes = (["oversubscribed"] if K > cores else []) + (["noisy"] if st_["gpipe"]["noisy"] else [])
        trow["note"] = ", ".join(notes)
        time_rows.append(trow)
    write(args, families, runs, rows, time_rows, time.perf_counter() - t0)


MEM_COLS = (
    "model|model|; K|K|; stage|stage|; layers|layers|; model_mb|model state MB|.1f; gpipe_mb|GPipe peak act. MB|.2f; "
    "1f1b_mb|1F1B peak act. MB|.2f; zb-h1_mb|ZB-H1 peak act. MB|.2f; interleaved-1f1b_mb|interleaved peak act. MB|.2f; "
    "zb-v_mb|ZB-V peak act. MB|.2f; "
    "gpipe_inflight|GPipe in flight|; 1f1b_inflight|1F1B in flight|; zb-h1_inflight|ZB-H1 in flight|; "
    "interleaved-1f1b_inflight|interleaved in flight|.2f; zb-v_inflight|ZB-V in flight|.2f; "
    "ratio|1F1B / GPipe|.3f; ideal|in-flight ratio|.3f; bound|target 1.25·K/M (stage 0)|.3f; met|met|"
)
TIME_COLS = (
    "model|model|; K|K|; M|M|; gpipe_ms|GPipe step ms|.0f; 1f1b_ms|1F1B step ms|.0f; zb-h1_ms|ZB-H1 step ms|.0f; "
    "interleaved-1f1b_ms|interleaved step ms|.0f; zb-v_ms|ZB-V step ms|.0f; time_ratio|1F1B / GPipe time|.3f; "
    "zb_time_ratio|ZB-H1 / 1F1B time|.3f; il_time_ratio|interleaved / 1F1B time|.3f; zbv_time_ratio|ZB-V / 1F1B "
    "time|.3f; zb-h1_worst_vs_1f1b|worst stage's peak act., ZB-H1 / 1F1B|.3f; interleaved-1f1b_worst_vs_1f1b|worst "
    "stage's peak act., interleaved / 1F1B|.3f; zb-v_worst_vs_1f1b|worst stage's peak act., ZB-V / 1F1B|.3f; "
    "worst_ratio|worst stage's peak act., 1F1B / GPipe|.3f; clean|clean steps (GPipe/1F1B/ZB-H1 of timed)|; note|note|"
)


def table(rows: list[dict], spec: str) -> str:
    return report.markdown_table(rows, [tuple(c.strip().split("|")) for c in spec.split(";")])  # type: ignore[misc]


def write(args: argparse.Namespace, families: dict, runs: list, rows: list, time_rows: list, total: float) -> None:
    env = report.environment(threads_per_process=1, processes="one per stage, fresh per model and K (gloo)")
    command = report.command_line("memory")
    md = [
        "# 1F1B, ZB-H1, interleaved 1F1B and ZB-V vs GPipe, the loss per micro-batch: peak activation and step time",
        "",
    ]
    md += [*report.environment_lines(env), f"- Command: `{command}`; total {total:.0f} s", "", METHOD, ""]
    md += [f"- {n}: `{families[n]}`, size {families[n]['unit']} = {families[n]['size']}" for n in args.models]
    md += ["", f"## Peak activation per stage (M = {args.chunks}, checkpoint=never)", "", table(rows, MEM_COLS)]
    md += ["", "## Step time, the schedules side by side", "", table(time_rows, TIME_COLS)]
    data = {"command": command, "environment": env, "chunks": args.chunks, "device": args.device, "runs": runs}
    data |= {"memory": rows, "time": time_rows, "total_s": total, "families": {n: families[n] for n in args.models}}
    paths = report.write("memory_schedules", data, "\n".join(md), out_dir=args.out_dir, plot=plot)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())}")


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded): peak activation per stage under each schedule it has."""
    rows = data["memory"]
    fig, axes = report.subplots(figsize=(max(7.0, 0.95 * len(rows) + 1.5), 4.6))
    ax = axes[0][0]
    labels = [f"{r['model']}\nK={r['K']}, stage {r['stage']}" for r in rows]
    shown = [s for s in SCHEDULES if rows and f"{s}_mb" in rows[0]]  # older files: GPipe and 1F1B
    width = 0.8 / max(1, len(shown))
    for j, s in enumerate(shown):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[f"{s}_mb"] for r in rows], width, label=LABELS.get(s, s))
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(xlabel="model, K (stages), stage index", ylabel="peak activation of the step (MiB)")
    report.legend_right(ax, title="schedule")
    what = (
        f"Peak activation per stage by schedule: the loss per micro-batch (forward_backward), M = {data['chunks']}, "
        "checkpoint=never"
    )
    return report.title(fig, what, data["environment"])
