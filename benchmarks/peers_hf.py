"""A HuggingFace Llama pipelined by ours vs by torch.distributed.pipelining (K = 2), fixed and varied length."""

# Run it from the repo root: python -m benchmarks.peers_hf (--smoke: a tiny model, about half a minute).
# Ours: causal_lm_backbone's stages under GPipeStage.forward_backward, causal_lm_loss per micro-batch on the last
# stage. torch's: the HF model copied per stage with what the stage does not hold deleted, its own forward computing
# the mask and the rotary embeddings (benchmarks/_lib/hf_pipelines.py), under ScheduleGPipe / Schedule1F1B with the
# same loss. Both with every micro-batch recomputed (checkpoint="always" / one torch.utils.checkpoint per stage),
# and ours also with its default except_last; all in the same two processes, alternating step by step.

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch.distributed as dist

from benchmarks._lib import hf_pipelines as hf
from benchmarks._lib import report
from benchmarks._lib.machine import (
    Timing,
    add_timing_args,
    background_load,
    broadcast_from_last,
    cpu_snapshot,
    launch,
    max_over_ranks,
    measure,
    probe,
    stats,
    timed,
    wait_quiet,
    zeroed,
)
from benchmarks._lib.peers_variable import REL_TOL, collect_probes, plot_peers, rel, start_probes, variable_summary

LENGTHS, SMOKE_LENGTHS = [64, 96, 48, 112, 32, 128, 80, 40, 120, 56], [16, 24, 8, 12]
OURS = {  # system: (schedule, checkpoint)
    "ours gpipe": ("gpipe", "always"),
    "ours 1f1b": ("1f1b", "always"),
    "ours gpipe (except_last)": ("gpipe", "except_last"),
    "ours 1f1b (except_last)": ("1f1b", "except_last"),
}
TORCH = {"torch GPipe": "gpipe", "torch 1F1B": "1f1b"}
SYSTEMS = (*OURS, *TORCH, "plain")
RATIOS = {  # ratio of throughputs: (numerator system, denominator system)
    "gpipe_torch": ("ours gpipe", "torch GPipe"),
    "1f1b_torch": ("ours 1f1b", "torch 1F1B"),
    "gpipe_el_torch": ("ours gpipe (except_last)", "torch GPipe"),
    "1f1b_el_torch": ("ours 1f1b (except_last)", "torch 1F1B"),
    "ours_plain": ("ours 1f1b (except_last)", "plain"),
    "torch_plain": ("torch 1F1B", "plain"),
}
VAR_SYSTEMS = ("plain", "ours 1f1b", "ours 1f1b (except_last)", "torch 1F1B rebuilt per step")
FIXED_COLS = (
    "system|system|; M|M|; median_ms|median ms|.1f; min_ms|min|.1f; max_ms|max|.1f; samples_per_s|samples/s|.1f; "
    "clean|clean/timed|; grad_diff|max abs. grad diff vs plain|.1e"
)
RATIO_COLS = (
    "M|M|; gpipe_torch|**ours gpipe / torch GPipe** (same remat.)|.2f; 1f1b_torch|**ours 1f1b / torch 1F1B** (same "
    "remat.)|.2f; gpipe_el_torch|ours gpipe (except_last) / torch GPipe|.2f; 1f1b_el_torch|ours 1f1b (except_last) / "
    "torch 1F1B|.2f; ours_plain|ours 1f1b (except_last) / plain|.2f; torch_plain|torch 1F1B / plain|.2f; "
    "paired_gpipe_torch|gpipe, median of paired steps|.2f; paired_1f1b_torch|1f1b, median of paired steps|.2f"
)
VAR_COLS = (
    "system|system|; steps|clean/timed steps|; tokens_per_s|tokens/s|.0f; us_per_token|µs/token|.1f; "
    "vs_plain|vs plain|.2f; max_rel_diff|max rel. loss diff vs plain|.1e; match|≤ {tol:g}|"
)
STEP_COLS = "step|step|; L|length|; " + "; ".join(f"{n}|{n} ms|.1f" for n in VAR_SYSTEMS) + "; loss|plain loss|.6f"


def run_job(rank: int, world: int, job: dict) -> dict:
    shape, last = job["shape"], rank == 1
    model, ids = hf.build_llama(shape), hf.tokens(shape, shape["seq"])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, probe())
    ref = copy.deepcopy(model)  # the whole model on the whole batch, once: the gradients every system must give
    hf.plain_step(ref, ids)
    ref_grads = hf.plain_grads(ref)
    plain = copy.deepcopy(model)  # timed on the last rank only; rank 0 waits in the step's closing barrier
    out: dict[str, Any] = {"probe_gflops": gathered, "fixed": {}}
    for M in job["micro_batches"]:
        groups = {name: dist.new_group([0, 1]) for name in SYSTEMS if name != "plain"}
        runners, grads_of = {}, {}
        for name, (schedule, mode) in OURS.items():
            stage = hf.ours(model, shape, M, groups[name], mode)
            runners[name] = zeroed(stage, lambda s=stage, k=schedule: hf.ours_step(s, ids, k))
            grads_of[name] = lambda s=stage: hf.ours_grads(s)
        for name, schedule in TORCH.items():
            built, module, names = hf.build_torch(model, shape, rank, M, groups[name], schedule)
            runners[name] = zeroed(module, lambda b=built: hf.torch_step(b, last, ids))
            grads_of[name] = lambda n=names: hf.torch_grads(n)
        runners["plain"] = zeroed(plain, lambda: hf.plain_step(plain, ids) if last else None)
        grad_diff: dict[str, float] = {}

        def compare(grads_of: dict = grads_of, grad_diff: dict = grad_diff) -> None:
            for name, get in grads_of.items():
                grad_diff[name] = max_over_ranks(hf.max_grad_diff(get(), ref_grads))
            grad_diff["plain"] = 0.0

        m = measure(runners, job["timing"], after_first=compare)
        out["fixed"][str(M)] = dict(records=m.records, first_loss=m.first, grad_diff=grad_diff, paused_s=m.paused_s)
    out["variable"] = variable_lengths(rank, model, job)
    return out


def variable_lengths(rank: int, model: Any, job: dict) -> list[dict]:
    """One step per length in turn, every system at the same length: ours' 1F1B (built once), the plain model, and
    torch's stage + Schedule1F1B rebuilt every step around the same stage module."""
    shape, M, last = job["shape"], job["var_m"], rank == 1
    ours = {n: hf.ours(model, shape, M, dist.new_group([0, 1]), OURS[n][1]) for n in VAR_SYSTEMS[1:3]}
    plain, module, g_torch = copy.deepcopy(model), hf.torch_stage(model, shape, rank)[0], dist.new_group([0, 1])
    steps: list[dict] = []
    lengths = job["lengths"] * job["var_passes"]
    for i, L in enumerate([job["lengths"][0], *lengths]):  # step 0: untimed warm-up at the first length
        ids = hf.tokens(shape, L, seed=1000 + i)
        runners = {
            "plain": zeroed(plain, lambda ids=ids: hf.plain_step(plain, ids) if last else None),
            **{n: zeroed(s, lambda s=s, ids=ids: hf.ours_step(s, ids, "1f1b")) for n, s in ours.items()},
            "torch 1F1B rebuilt per step": zeroed(
                module, lambda ids=ids: hf.torch_rebuilt_step(module, rank, M, g_torch, ids)
            ),
        }
        names = list(runners) if i % 2 == 0 else list(reversed(runners))
        rec: dict[str, Any] = {"step": i - 1, "L": L, "tokens": shape["batch"] * L, "warmup": i == 0}
        for name in names:
            runners[name].reset()
            t, result = timed(runners[name].step)
            rec[name] = {**t, "ms": t["s"] * 1e3, "clean": t["foreign_cores"] < job["timing"].clean_threshold}
            rec[name]["loss"] = broadcast_from_last(result)
        for name in VAR_SYSTEMS:
            rec[name]["rel_diff_vs_plain"] = rel(rec[name]["loss"], rec["plain"]["loss"])
        steps.append(rec)
    return steps


# ------------------------------------------------------------------------------------------------------- driver
def parse_args() -> tuple[argparse.Namespace, Timing]:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], metavar="M")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="sequence length of each step")
    parser.add_argument("--var-passes", type=int, default=1, help="timed passes over --lengths (after 1 warm-up step)")
    parser.add_argument("--out-dir", default=str(report.RESULTS / "peers_hf"))
    parser.add_argument("--smoke", action="store_true", help="tiny model, M=4, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.micro_batches, args.lengths, args.var_passes = [4], SMOKE_LENGTHS, 1
        args.steps, args.max_steps, args.warmup, args.wait_quiet = 5, 5, 1, 0.0
    if not all(1 <= m <= (hf.SMOKE_LLAMA if args.smoke else hf.LLAMA)["batch"] for m in args.micro_batches):
        parser.error("M must be in 1..batch size")
    return args, Timing.from_args(parser, args)


def tabulate(raw: dict, micro_batches: list[int], batch: int) -> tuple[list[dict], list[dict]]:
    """Per system and M: step statistics and the first step's sanity; per M: the side-by-side ratios."""
    rows, ratios = [], []
    for M in micro_batches:
        entry = raw["fixed"][str(M)]
        st = {name: stats(entry["records"][name], batch) for name in SYSTEMS}
        med = {name: st[name]["median_ms"] for name in SYSTEMS}
        for name in SYSTEMS:
            clean = f"{st[name]['clean_steps']}/{st[name]['timed_steps']}"
            rows.append({"system": name, "M": M, **st[name], "clean": clean, "grad_diff": entry["grad_diff"][name]})
            rows[-1]["first_loss"] = entry["first_loss"][name]
        ratios.append({"M": M, **{k: med[b] / med[a] for k, (a, b) in RATIOS.items()}})
        for k in ("gpipe_torch", "1f1b_torch"):  # step s of both ran in the same round, side by side
            a, b = (entry["records"][n] for n in RATIOS[k])
            ratios[-1][f"paired_{k}"] = statistics.median(y["s"] / x["s"] for x, y in zip(a, b))
    return rows, ratios


def plot(data: dict) -> Any:
    """The figure of a results file (see ``peers_variable.plot_peers``; torch's bars hatched)."""
    shape = data["job"]["shape"]
    what = (
        f"A HuggingFace Llama pipelined by ours vs torch.distributed.pipelining, K = 2: {shape['layers']} decoder "
        f"layers (hidden {shape['hidden']}, vocabulary {shape['vocab']}), loss inside the pipeline"
    )
    fixed = f"fixed shape, batch {shape['batch']} × {shape['seq']} tokens"
    return plot_peers(data, fixed, "torch 1F1B\nbuilt once", what, hatch_torch=True, ncol=4)


def markdown(
    env: dict, args: argparse.Namespace, shape: dict, raw: dict, tables: tuple, probes: dict, extra: str
) -> str:
    rows, ratios, var_rows = tables
    per_step = [{"step": s["step"], "L": s["L"], **{n: s[n]["ms"] for n in VAR_SYSTEMS}} for s in raw["variable"]]
    for rec, s in zip(per_step, raw["variable"]):
        rec["loss"] = s["plain"]["loss"]
    sanity = "; ".join(f"M={r['M']} {r['system']} {r['first_loss']:.6f}" for r in rows)
    s = shape
    model = (
        f"Model: `LlamaForCausalLM` (transformers, random init), hidden {s['hidden']}, FFN {s['ffn']}, {s['layers']} "
        f"decoder layers, {s['heads']} heads ({s['kv_heads']} KV heads), vocabulary {s['vocab']}, untied head, fp32, "
        f"sdpa attention; causal_lm_loss (next-token cross-entropy) per micro-batch on the last stage; K = 2 (stage 0: "
        f"embedding + {s['layers'] // 2} layers, stage 1: {s['layers'] // 2} layers + norm + head). **ours**: "
        "`causal_lm_backbone(model)` under `GPipeStage.forward_backward(ids, loss, schedule=...)`, with "
        '`checkpoint="always"` (every micro-batch recomputed on every stage) or, marked `(except_last)`, ours\' '
        "default. **torch**: `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` over a deep copy of the HF model per "
        "stage with the modules it does not hold deleted (torchtitan's way), run by the HF model's own forward (the "
        "causal mask and rotary embeddings computed once per micro-batch on each stage, as the model does), under one "
        "`torch.utils.checkpoint` per stage (every micro-batch recomputed: the same re-materialization as ours' "
        "`always`). `plain` = the HF model on the whole batch in one process (rank 1, rank 0 waits). All alternate "
        "step by step in the same two processes; a step = forward + loss + backward between barriers; medians of "
        f"clean steps after {args.warmup} warm-up."
    )
    var = f"{args.lengths} × {args.var_passes} pass(es), batch {s['batch']}, M={args.micro_batches[0]}"
    probe_lines = []
    for name, p in probes.items():
        probe_lines.append(f"- **{name}** {p['lengths']}: {p['verdict']}")
        for r in p["ranks"]:
            steps = ", ".join(f"L={t['L']} " + (f"`{t['error']}`" if "error" in t else "ok") for t in r["steps"])
            probe_lines.append(
                f"  - rank {r['rank']}: {r['exit']}; steps {steps}" + f"; `{r['abort']}`" * bool(r["abort"])
            )
    blocks = [
        "# Peers, a HuggingFace Llama: ours vs torch.distributed.pipelining ScheduleGPipe and Schedule1F1B",
        "\n".join([*report.environment_lines(env), extra]),
        model,
        f"## Fixed shape (batch {s['batch']} × {s['seq']} tokens)",
        report.markdown_table(rows, report.columns(FIXED_COLS)),
        report.markdown_table(ratios, report.columns(RATIO_COLS)),
        f"First-step loss, same weights and batch: {sanity}",
        f"## Variable sequence length: {var}",
        "`torch 1F1B rebuilt per step`: a new torch `PipelineStage` + `Schedule1F1B` around the same stage module "
        "every step; its time includes the build and torch's runtime shape inference. Ours' stages are built once. "
        "Step -1 is the warm-up.",
        report.markdown_table(var_rows, report.columns(VAR_COLS.format(tol=REL_TOL))),
        report.markdown_table(per_step, report.columns(STEP_COLS)),
        "### torch's Schedule1F1B built once (first length), then fed the next lengths",
        "\n".join(probe_lines),
        f"Command: `{report.command_line('peers_hf')}`",
    ]
    return "\n\n".join(blocks)


def main() -> None:
    args, timing = parse_args()
    shape = hf.SMOKE_LLAMA if args.smoke else hf.LLAMA
    M0, t_start = args.micro_batches[0], time.perf_counter()
    how = "2 workers spawned by the script (gloo, 127.0.0.1), plain on rank 1 while rank 0 waits; 2 processes forked"
    env = report.environment(threads_per_process=1, processes=how + " per probe of torch's schedule built once")
    job = dict(shape=shape, timing=timing, micro_batches=args.micro_batches, var_m=M0, lengths=args.lengths)
    job["var_passes"] = args.var_passes
    print(f"# {env['cpu_model']}, torch {env['torch']}; {shape}; M={args.micro_batches}", flush=True)
    probe_lengths = {"the run's lengths": args.lengths}
    if min(args.lengths) < args.lengths[0]:
        probe_lengths["first change shrinks"] = [args.lengths[0], min(args.lengths)]
    pg_timeout, limit = (10.0, 60.0) if args.smoke else (30.0, 90.0)
    # --smoke runs the probes (untimed) alongside the main job, to be quick; a measured run, after it.
    probing = (probe_lengths, shape, M0, pg_timeout, hf.probe_worker)
    handle = start_probes(*probing) if args.smoke else None
    waited = wait_quiet(args.wait_quiet, args.clean_threshold)
    load_before, snap = os.getloadavg(), cpu_snapshot()
    raw = launch(run_job, 2, job)
    background, background_line = background_load(snap, load_before)
    print(f"# main job done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    probes = collect_probes(handle or start_probes(*probing), limit)
    rows, ratios = tabulate(raw, args.micro_batches, shape["batch"])
    var_rows = variable_summary(raw["variable"], VAR_SYSTEMS)
    total, gf = time.perf_counter() - t_start, raw["probe_gflops"]
    extra = (
        f"- Machine check: both ranks at once {gf[0]:.0f} and {gf[1]:.0f} GFLOP/s (1-thread 512² matmul); waited "
        f"{waited:.0f} s for a quiet machine; {background_line.lstrip('# ')}; total {total:.0f} s"
    )
    md = markdown(env, args, shape, raw, (rows, ratios, var_rows), probes, extra)
    print(md)
    data = dict(command=report.command_line("peers_hf"), environment=env, job={**job, "timing": vars(timing)})
    data.update(machine_check={"probe_gflops": gf, **background}, fixed=rows, ratios=ratios, variable=var_rows)
    data.update(variable_steps=raw["variable"], torch_built_once=probes, raw_fixed=raw["fixed"], total_s=total)
    paths = report.write("peers_hf", data, md, out_dir=args.out_dir, plot=plot)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
