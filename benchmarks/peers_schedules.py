"""Ours vs torch.distributed.pipelining beyond GPipe's bubble: zero-bubble, interleaved and V schedules, namesakes."""

# What it runs: peers.py's encoder stack (8 Transformer encoder layers, MSE loss) at K = 2 on two processes (gloo,
# one thread each), every system alternating step by step in the same processes, a step = forward + loss +
# backward between barriers, medians of clean steps. torch's stages run their layers under one
# torch.utils.checkpoint (every micro-batch recomputed); ours run with checkpoint="always" (the same
# re-materialization) and, marked "(except_last)", with ours' default. Interleaved: v = 2 chunks of 2 layers per
# rank (rank r holds stages r and r + 2) on both sides; ZB-V: rank r holds stages r and 3 − r (the loss on rank 0)
# on both sides. With --rematerialization never neither side recomputes (torch's stages run their layers plainly,
# ours checkpoint="never"): the same work, where the host work per op and per message decides. From the repo root:
#   python -m benchmarks.peers_schedules            (--smoke: a small model, about half a minute)

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._lib import report
from benchmarks._lib import workloads as wl
from benchmarks._lib.machine import (
    Timing,
    add_timing_args,
    launch,
    max_over_ranks,
    measure,
    stats,
    wait_quiet,
    zeroed,
)
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.schedule.registry import lookup

FULL = {k: getattr(wl, k) for k in ("LAYERS", "D_MODEL", "HEADS", "FFN", "BATCH", "SEQ")}
SMOKE = wl.SMOKE_ENCODER
V = 2  # virtual stages per rank of the interleaved schedules
OURS = {  # system: (schedule, checkpoint, virtual stages per rank)
    "ours 1f1b": ("1f1b", "always", 1),
    "ours zb-h1": ("zb-h1", "always", 1),
    "ours interleaved-1f1b": ("interleaved-1f1b", "always", V),
    "ours interleaved-zb": ("interleaved-zb", "always", V),
    "ours zb-v": ("zb-v", "always", V),
    "ours 1f1b (except_last)": ("1f1b", "except_last", 1),
    "ours zb-h1 (except_last)": ("zb-h1", "except_last", 1),
    "ours interleaved-1f1b (except_last)": ("interleaved-1f1b", "except_last", V),
    "ours zb-v (except_last)": ("zb-v", "except_last", V),
}
TORCH = {  # system: (torch's schedule class, virtual stages per rank)
    "torch 1F1B": ("Schedule1F1B", 1),
    "torch ZB1P": ("ScheduleInterleavedZeroBubble", 1),
    "torch Interleaved1F1B": ("ScheduleInterleaved1F1B", V),
    "torch InterleavedZB": ("ScheduleInterleavedZeroBubble", V),
    "torch ZBV": ("ScheduleZBVZeroBubble", V),
}
NAMESAKES = {  # ratio of throughputs at the same re-materialization: (ours, torch's)
    "1f1b": ("ours 1f1b", "torch 1F1B"),
    "zb": ("ours zb-h1", "torch ZB1P"),
    "interleaved": ("ours interleaved-1f1b", "torch Interleaved1F1B"),
    "interleaved_zb": ("ours interleaved-zb", "torch InterleavedZB"),
    "zbv": ("ours zb-v", "torch ZBV"),
}
FIXED_COLS = (
    "system|system|; M|M|; median_ms|median ms|.1f; min_ms|min|.1f; max_ms|max|.1f; samples_per_s|samples/s|.1f; "
    "clean|clean/timed|; grad_diff|max abs. grad diff vs plain|.1e"
)
RATIO_COLS = (
    "M|M|; 1f1b|ours 1f1b / torch 1F1B|.2f; zb|**ours zb-h1 / torch ZB1P**|.2f; interleaved|**ours "
    "interleaved-1f1b / torch Interleaved1F1B**|.2f; interleaved_zb|**ours interleaved-zb / torch "
    "InterleavedZB**|.2f; zbv|**ours zb-v / torch ZBV**|.2f; fastest|**ours fastest / torch fastest**|.2f; "
    "ours_fastest|ours fastest|; torch_fastest|torch fastest|"
)


def _ours(model: nn.Sequential, M: int, group: Any, schedule: str, mode: str, v: int) -> GPipeStage:
    n, placement = wl.LAYERS // (2 * v), lookup(schedule).placement
    return GPipeStage(
        copy.deepcopy(model), chunks=M, balance=[n] * (2 * v), checkpoint=mode, group=group, virtual_stages=v,
        placement=placement,
    )  # fmt: skip


def _held(rank: int, v: int, cls_name: str) -> list[int]:
    """The stages this rank holds of the 2v: interleaved r, r + 2, …; in ZBV's V, r and 3 − r."""
    return [rank, 2 * v - 1 - rank] if cls_name == "ScheduleZBVZeroBubble" else list(range(rank, 2 * v, 2))


def _systems(remat: str) -> dict[str, tuple[str, str, int]]:
    """Ours at ``remat``: every micro-batch recomputed ("always", with ours' default beside it) or none ("never")."""
    if remat == "never":
        return {name: (k, "never", v) for name, (k, mode, v) in OURS.items() if mode == "always"}
    return OURS


def _torch(
    model: nn.Sequential, rank: int, M: int, group: Any, cls_name: str, v: int, remat: str
) -> tuple[Any, nn.Module]:
    """torch's schedule over this rank's v stages (``_held``), each checkpointed whole (or, ``never``, plain)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    n, layers, held = wl.LAYERS // (2 * v), list(model), _held(rank, v, cls_name)
    mode = "none" if remat == "never" else "stage"
    modules = [wl.CheckpointedStage(copy.deepcopy(layers[s * n : (s + 1) * n]), mode) for s in held]
    stages = [PipelineStage(m, s, 2 * v, torch.device("cpu"), group=group) for m, s in zip(modules, held)]
    cls = getattr(pipelining, cls_name)
    schedule = cls(stages[0] if cls_name == "Schedule1F1B" else stages, n_microbatches=M, loss_fn=F.mse_loss)
    return schedule, nn.ModuleList(modules)


def _torch_step(schedule: Any, rank: int, x: torch.Tensor, y: torch.Tensor, last: int = 1) -> float | None:
    """torch's step: rank 0 feeds the input (it holds the first stage), rank ``last`` the target (it holds the last:
    rank 0 too in a V, where rank 1 holds only middle stages)."""
    inputs = (x,) if rank == 0 else ()
    if rank != last:
        schedule.step(*inputs, return_outputs=False)
        return None
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=y, losses=losses, return_outputs=False)
    return torch.stack([loss.detach() for loss in losses]).mean().item()


def run_job(rank: int, world: int, job: dict) -> dict:
    wl.configure(job["shape"])
    model, (x, y) = wl.build_encoder(), wl.encoder_batch()
    ref = copy.deepcopy(model)
    wl.plain_step(ref, x, y)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out: dict[str, Any] = {"fixed": {}}
    ours = _systems(job["rematerialization"])
    for M in job["micro_batches"]:
        groups = {name: dist.new_group([0, 1]) for name in (*ours, *TORCH)}
        runners, grads_of = {}, {}
        for name, (schedule, mode, v) in ours.items():
            stage = _ours(model, M, groups[name], schedule, mode, v)
            runners[name] = zeroed(stage, lambda s=stage, k=schedule: wl.ours_forward_backward(s, x, y, k))
            grads_of[name] = lambda s=stage: {n: p.grad for n, p in s.named_parameters()}
        for name, (cls_name, v) in TORCH.items():
            schedule, modules = _torch(model, rank, M, groups[name], cls_name, v, job["rematerialization"])
            last = 0 if cls_name == "ScheduleZBVZeroBubble" else 1
            runners[name] = zeroed(modules, lambda s=schedule, last=last: _torch_step(s, rank, x, y, last))
            n = wl.LAYERS // (2 * v)
            starts = [s * n for s in _held(rank, v, cls_name)]

            def torch_grads(modules: nn.Module = modules, starts: list[int] = starts) -> dict[str, torch.Tensor]:
                got = {}
                for start, m in zip(starts, modules):  # CheckpointedStage.layers[i] is layer start + i
                    for name, p in m.layers.named_parameters():
                        i, rest = name.split(".", 1)
                        got[f"{start + int(i)}.{rest}"] = p.grad
                return got

            grads_of[name] = torch_grads
        grad_diff: dict[str, float] = {}

        def compare(grads_of: dict = grads_of, grad_diff: dict = grad_diff) -> None:
            for name, get in grads_of.items():
                got = get()
                d = max((g - ref_grads[n]).abs().max().item() for n, g in got.items() if g is not None)
                grad_diff[name] = max_over_ranks(d)

        m = measure(runners, job["timing"], after_first=compare)
        out["fixed"][str(M)] = dict(records=m.records, grad_diff=grad_diff, paused_s=m.paused_s)
    return out


def tabulate(raw: dict, micro_batches: list[int], remat: str) -> tuple[list[dict], list[dict]]:
    rows, ratios = [], []
    ours = _systems(remat)
    for M in micro_batches:
        entry = raw["fixed"][str(M)]
        systems = (*ours, *TORCH)
        st = {name: stats(entry["records"][name], wl.BATCH) for name in systems}
        med = {name: st[name]["median_ms"] for name in systems}
        for name in systems:
            clean = f"{st[name]['clean_steps']}/{st[name]['timed_steps']}"
            rows.append({"system": name, "M": M, **st[name], "clean": clean, "grad_diff": entry["grad_diff"][name]})
        ours_fastest, torch_fastest = min(ours, key=med.__getitem__), min(TORCH, key=med.__getitem__)
        ratio = {k: med[b] / med[a] for k, (a, b) in NAMESAKES.items()}
        ratio |= {"fastest": med[torch_fastest] / med[ours_fastest], "ours_fastest": ours_fastest}
        ratios.append({"M": M, **ratio, "torch_fastest": torch_fastest})
    return rows, ratios


def plot(data: dict) -> Any:
    """Samples/s per system and M, ours and torch's namesakes side by side."""
    rows = data["fixed"]
    micro_batches = list(dict.fromkeys(r["M"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = report.subplots(1, 1, figsize=(11, 5))
    a = axes[0][0]
    w = 0.8 / len(systems)
    for j, name in enumerate(systems):
        ys = [next(r["samples_per_s"] for r in rows if r["system"] == name and r["M"] == M) for M in micro_batches]
        xs = [i + (j - (len(systems) - 1) / 2) * w for i in range(len(micro_batches))]
        a.bar(xs, ys, w, color=f"C{j}", label=name, hatch="//" if name.startswith("torch") else None)
    a.set_xticks(range(len(micro_batches)), [f"M={M}" for M in micro_batches])
    a.set(xlabel="M (micro-batches)", ylabel="throughput (samples/s, median step)")
    report.legend_right(a, fontsize=8)
    shape = data["job"]["shape"]
    what = (
        f"Schedules beyond GPipe's bubble, ours vs torch.distributed.pipelining, K = 2: {shape['LAYERS']} encoder "
        f"layers (d {shape['D_MODEL']}), batch {shape['BATCH']} × {shape['SEQ']}"
    )
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], metavar="M")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument(
        "--rematerialization", choices=["always", "never"], default="always",
        help="always: every micro-batch recomputed on both sides; never: none on either side",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="small model, M=4, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.micro_batches, args.steps, args.max_steps, args.warmup, args.wait_quiet = [4], 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    shape = SMOKE if args.smoke else FULL
    wl.configure(shape)
    t_start = time.perf_counter()
    env = report.environment(threads_per_process=1, processes="2 workers spawned by the script (gloo, 127.0.0.1)")
    job = dict(shape=shape, timing=timing, micro_batches=args.micro_batches, rematerialization=args.rematerialization)
    waited = wait_quiet(args.wait_quiet, args.clean_threshold)
    raw = launch(run_job, 2, job)
    rows, ratios = tabulate(raw, args.micro_batches, args.rematerialization)
    total = time.perf_counter() - t_start
    md = "\n\n".join(
        [
            "# Peers beyond GPipe's bubble: ours vs torch.distributed.pipelining",
            "\n".join(
                [*report.environment_lines(env), f"- waited {waited:.0f} s for a quiet machine; total {total:.0f} s"]
            ),
            f"Model: {wl.LAYERS} × TransformerEncoderLayer(d={wl.D_MODEL}, heads={wl.HEADS}, ffn={wl.FFN}, dropout "
            f"0), MSE loss per micro-batch on the last stage, batch {wl.BATCH} × {wl.SEQ}, K = 2; interleaved: "
            f"v = {V} chunks of {wl.LAYERS // 4} layers per rank. "
            + (
                "No re-materialization on either side: torch's stages run their layers plainly, ours "
                'checkpoint="never". '
                if args.rematerialization == "never"
                else "torch's stages: one torch.utils.checkpoint each (every micro-batch recomputed); ours: "
                'checkpoint="always" (the same) or, marked (except_last), ours\' default. '
            )
            + "Every system alternates step by step in the same two processes; a step = forward + loss + "
            "backward between barriers; medians of clean steps. Ratios: throughput of the first over the second.",
            report.markdown_table(rows, report.columns(FIXED_COLS)),
            report.markdown_table(ratios, report.columns(RATIO_COLS)),
            f"Command: `{report.command_line('peers_schedules')}`",
        ]
    )
    print(md)
    data = dict(command=report.command_line("peers_schedules"), environment=env, job={**job, "timing": vars(timing)})
    data.update(fixed=rows, ratios=ratios, raw_fixed=raw["fixed"], total_s=total)
    paths = report.write("peers_schedules", data, md, out_dir=args.out_dir, plot=plot)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
