"""GPipe's Table 1 on this machine: peak memory per stage, and the largest model that fits a per-stage budget."""

# How and why it measures what it does: METHOD below (it also goes into the Markdown output).

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import launch
from benchmarks._lib.memory_models import FAMILIES, SMOKE, build, layer_costs, loss_fn  # models, batches, balance
from benchmarks._lib.memory_probe import MALLOC_ENV, Meter, counting_saved, state_bytes, storages  # the meters
from benchmarks._lib.memory_schedules import compare  # --schedules
from benchmarks._lib.memory_search import largest  # the size search
from lightning_gpipe.pipe import GPipeStage

METHOD = """\
**Method.** Every run is one training step (forward, loss, backward, Adam step with `foreach=False`), measured after
a warm-up step (Naive-1: the same batch; pipelines: one micro-batch of the same shape), in fresh processes: one per
stage, one thread each, gloo on 127.0.0.1 (`--smoke` reuses processes). Gradients are zeroed in place, so they
count as model memory. *Model memory* of a stage = the bytes of its parameters, buffers, gradients and Adam's two
moments, counted from the tensors (16 B per fp32 parameter). *Peak activation* = the peak, during the measured
step, of the memory allocated since it began: activations, temporaries, received tensors, the loss. On CPU it is
counted exactly by a `TorchDispatchMode` that adds up the bytes of every storage an op creates (not in-place results
or views) and subtracts them when the storage is freed (a weak reference tells); memory a kernel allocates and
frees internally is not seen. Check on every CPU run: the resident set's high-water mark (VmHWM, reset through
/proc/self/clear_refs) minus the resident set before the step, with glibc told (`MALLOC_MMAP_THRESHOLD_=4096`, a
small trim threshold, one arena) to map every block of 4 KiB or more on its own and unmap it when freed, so that
the resident set follows the live memory; it also holds what is not a tensor (page rounding of small blocks,
Python objects, gloo's buffers, kernel scratch), so it reads a little higher. On CUDA:
`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, minus `memory_allocated` before. The process's
fixed footprint (interpreter, libraries: ~200 MB resident on CPU) is the same in every configuration and not counted.

*Largest size*: the budget is for the worst stage's model memory + peak activation. From the table's size, a size is
predicted and run for real, again and again, until a size that fits and the next size up, which does not, have both
been measured: every maximum is bracketed by real runs (`verified`; else `--max-runs` ran out). Prediction: the mean
stage's model memory as a + c·size^p (p = 1 for L, 2 for D) and its activations as a + b·size, each through the two
measured sizes nearest the budget (through zero while there is one), times the nearest one's worst/mean stage ratio;
Pipeline-2 and -4 start from the previous pipeline's result × (K ratio)^(1/p). Naive-1 is the plain model in one
process, no re-materialization; Pipeline-K runs `GPipeStage` (re-materialization, `checkpoint="except_last"`);
for K > 1 its layers are split to even out 16 B × parameters + the bytes a layer saves for backward on one
micro-batch (the last layer also carries 3× the joined output, for the loss), estimated on stage 0."""
CONFIGS = {"Naive-1": 1, "Pipeline-1": 1, "Pipeline-2": 2, "Pipeline-4": 4}  # name: K
MB = 2**20


# ----------------------------------------------------------------------------------------------------- worker
def run_config(rank: int, world: int, job: dict) -> list[dict]:
    """One configuration at one size: each stage's memory (gathered on rank 0)."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    spec, naive, M, cuda = job["spec"], job["naive"], job["M"], job["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.new_group(backend="nccl") if cuda and world > 1 else None  # gloo cannot carry CUDA tensors
    model, x, target = build(job["model"], spec, job["size"])
    total_params = sum(p.numel() for p in model.parameters())
    if naive:
        module: nn.Module = model
    else:
        costs = layer_costs(model, x, max(2, spec["N"] // M), spec["N"]) if world > 1 and rank == 0 else None
        balance: Any = [len(model)] if world == 1 else (lambda i, _layer: costs[i])
        module = GPipeStage(model, chunks=M, balance=balance, checkpoint="except_last", group=group, device=device)
        del model
    module.to(device)
    xs = tuple(t.to(device) for t in x) if isinstance(x, tuple) else (x.to(device),)
    target = target.to(device)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4, foreach=False)
    meter, marks, saved = Meter(device), {}, {}

    def step(n: int, count: bool) -> None:
        opt.zero_grad(set_to_none=False)
        x = tuple(t[:n] for t in xs) if len(xs) > 1 else xs[0][:n]
        if naive:
            with counting_saved(storages(module.parameters()) | storages(xs), saved) if count else nullcontext():
                out = module(x)
            marks.update(forward_live_bytes=meter.now(), output_bytes=out.untyped_storage().nbytes())
            loss_fn(out, target[:n]).backward()
        else:
            out = module(x if module.is_first else None)
            if module.is_last:
                loss_fn(out, target[:n]).backward()
            module.backward()
        opt.step()

    # Warm-up, so that gradients, Adam's state and the kernels' code exist before the measured step: Naive-1 on the
    # same batch, a pipeline on one micro-batch of the measured shape (kernels compiled for a shape, oneDNN's JIT
    # code, are resident memory and would otherwise show in the resident-set check).
    if not naive:
        module._chunks = 1  # private; stage 0 splits by it, the other stages follow the header
    step(spec["N"] if naive else spec["N"] // M, count=False)
    if not naive:
        module._chunks = M
    opt.zero_grad(set_to_none=False)
    gc.collect()
    if world > 1:
        dist.barrier()
    with meter.window():
        step(spec["N"], count=naive)  # on Naive-1 it also counts what autograd saves, for the cross-check
    row = {
        "stage": rank,
        "modules": len(module) if naive else len(list(module.children())),
        "params": sum(p.numel() for p in module.parameters()),
        "model_bytes": state_bytes(module, opt),
        "peak_activation_bytes": meter.peak(),
        "rss_peak_bytes": meter.rss_peak(),
        "total_params": total_params,
        "seconds": time.perf_counter() - t0,
    }
    if naive:
        row |= marks | {"saved_bytes": sum(saved.values())}
    rows: list[Any] = [row] * world
    if world > 1:
        dist.all_gather_object(rows, row)
    return rows


def run_jobs(rank: int, world: int, jobs: list[dict]) -> list[list[dict]]:
    return [run_config(rank, world, job) for job in jobs]


# ----------------------------------------------------------------------------------------------------- driver
def make_job(name: str, spec: dict, config: str, size: int, args: argparse.Namespace) -> dict:
    job = {"model": name, "spec": spec, "config": config, "naive": config == "Naive-1", "size": size}
    return job | {"M": 1 if config == "Naive-1" else args.chunks, "device": args.device}


def measure(jobs: list[dict], args: argparse.Namespace) -> list[dict]:
    """Real runs, all at one K, each in fresh processes (``--smoke``: one launch for all; K=1 in this process)."""
    K = CONFIGS[jobs[0]["config"]]
    if not args.smoke:
        results = [launch(run_jobs, K, [job])[0] for job in jobs]
    else:
        results = run_jobs(0, 1, jobs) if K == 1 else launch(run_jobs, K, jobs)
    runs = []
    for job, stages in zip(jobs, results):
        worst = max(s["model_bytes"] + s["peak_activation_bytes"] for s in stages)
        run = {k: job[k] for k in ("model", "config", "size", "M")} | {"K": K, "worst_bytes": worst, "stages": stages}
        runs.append(run | {"params": stages[0]["total_params"]})
        model_mb = " ".join(f"{s['model_bytes'] / MB:.1f}" for s in stages)
        act_mb = " ".join(f"{s['peak_activation_bytes'] / MB:.1f}" for s in stages)
        print(
            f"  {job['model']:<11} {job['config']:<10} {job['spec']['unit']}={job['size']:>3}: worst stage "
            f"{worst / MB:6.1f} MB (model {model_mb} | activations {act_mb}) {stages[0]['seconds']:.1f} s",
            flush=True,
        )
    return runs


# ----------------------------------------------------------------------------------------------------- output
def row(r: dict | None, **extra: Any) -> dict:
    """A run as a table row (sizes in MB), after ``extra``."""
    if r is None:
        return extra
    st = r["stages"]

    def per(key: str) -> str:
        return " / ".join("–" if s.get(key) is None else f"{s[key] / MB:.1f}" for s in st)

    return extra | {
        "size": r["size"],
        "params": r["params"] / 1e6,
        "model": sum(s["model_bytes"] for s in st) / MB,
        "model_stage": per("model_bytes"),
        "act_stage": per("peak_activation_bytes"),
        "rss_stage": per("rss_peak_bytes"),
        "act": max(s["peak_activation_bytes"] for s in st) / MB,
        "modules": " / ".join(str(s["modules"]) for s in st),
        "worst": r["worst_bytes"] / MB,
    }


def markdown(results: dict, env: dict, command: str, budget_mb: float, args: argparse.Namespace, notes: list) -> str:
    out = ["# Memory per stage and the largest model (GPipe Table 1)", "", *report.environment_lines(env), ""]
    out += [f"Command: `{command}`. Pipelines: M = {args.chunks}, batch split into equal micro-batches.", ""]
    out += [*notes, "", METHOD] if notes else [METHOD]
    for name, res in results.items():
        spec, u = res["spec"], res["spec"]["unit"]
        out += ["", f"## {name} (size = {u})", "", f"Model and batch: `{spec}`.", ""]
        out += [f"### Memory per stage at {u} = {spec['size']} (MB)", ""]
        cols = [("config", "config", ""), ("size", u, "d"), ("params", "params (M)", ".2f")]
        cols += [("model", "model memory, all stages", ".1f"), ("model_stage", "model memory per stage", "")]
        cols += [("act_stage", "peak activation per stage", ""), ("rss_stage", "resident-set growth per stage", "")]
        cols += [("modules", "modules per stage", ""), ("worst", "worst stage total", ".1f")]
        out.append(report.markdown_table([row(r, config=r["config"]) for r in res["table"]], cols))
        for r in res["table"][:1] if res["table"][0]["config"] == "Naive-1" else []:
            st = r["stages"][0]
            counted = st["saved_bytes"] + st["output_bytes"]
            out += [
                "",
                f"Cross-check (Naive-1, {u} = {r['size']}): at the end of the forward pass "
                f"{st['forward_live_bytes'] / MB:.2f} MB were live; autograd saved {st['saved_bytes'] / MB:.2f} MB "
                f"for backward (distinct storages; parameters and input excluded) and the output is "
                f"{st['output_bytes'] / MB:.2f} MB: measured / counted = {st['forward_live_bytes'] / counted:.3f}.",
            ]
        if res["largest"]:
            out += ["", f"### Largest {u} within {budget_mb:g} MB per stage (sizes in MB)", ""]
            naive = res["largest"].get("Naive-1", {}).get("run")
            rows = [
                row(f["run"], config=c, largest=f["largest"], verified="yes" if f["verified"] else "no")
                | {"runs": ", ".join(f"{x['size']}: {x['worst_bytes'] / MB:.0f}" for x in f["runs"])}
                | ({"ratio": f["run"]["params"] / naive["params"]} if naive and f["run"] else {})
                for c, f in res["largest"].items()
            ]
            cols = [("config", "config", ""), ("largest", f"largest {u}", ""), ("params", "params (M)", ".2f")]
            cols += [("ratio", "params / Naive-1", ".1f"), ("model", "model memory, all stages", ".1f")]
            cols += [("act", "peak activation, max stage", ".1f"), ("worst", "worst stage", ".1f")]
            cols += [("verified", "verified", ""), ("runs", f"real runs ({u}: worst stage MB)", "")]
            out.append(report.markdown_table(rows, cols))
    out += [
        "",
        "Paper (Table 1, 8 GB per accelerator): AmoebaNet-D Naive-1 82M → Pipeline-1 318M → Pipeline-8 1.8B "
        "parameters; Transformer-L Naive-1 3 → Pipeline-1 13 → Pipeline-8 103 layers.",
    ]
    return "\n".join(out)


UNITS = {"L": "Transformer layers L", "D": "AmoebaNet-D filters D"}  # what a family's size counts


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded). Top: model memory and peak activation per stage of every
    configuration at the table's size; bottom: the largest size within the budget per stage."""
    results, budget_mb = data["results"], data["budget_mb"]
    fig, axes = report.subplots(2, len(results), figsize=(6.5 * len(results), 8.5))
    for j, (name, res) in enumerate(results.items()):
        u, ax = res["spec"]["unit"], axes[0][j]
        labels = [f"{r['config']}\n{s['stage']}" for r in res["table"] for s in r["stages"]]
        model = [s["model_bytes"] / MB for r in res["table"] for s in r["stages"]]
        ax.bar(labels, model, label="parameters, gradients, Adam")
        act = [s["peak_activation_bytes"] / MB for r in res["table"] for s in r["stages"]]
        ax.bar(labels, act, bottom=model, label="peak activations")
        ax.set_title(f"{name}, {u} = {res['spec']['size']}: memory per stage", fontsize=10)
        ax.set(xlabel="configuration, stage index", ylabel="memory per stage (MiB)")
        ax.tick_params(axis="x", labelsize=7)
        found = {c: f for c, f in res["largest"].items() if f["largest"] is not None}
        bars = axes[1][j].bar(list(found), [f["largest"] for f in found.values()])
        axes[1][j].bar_label(bars, [f"{f['run']['params'] / 1e6:.1f}M params" for f in found.values()], fontsize=8)
        axes[1][j].set_title(f"{name}: largest {u} within {budget_mb:g} MiB per stage", fontsize=10)
        axes[1][j].set(xlabel="configuration", ylabel=f"largest {UNITS.get(u, u)}")
    report.legend_right(axes[0][-1])
    where = "on the GPU (torch.cuda.max_memory_allocated)" if data["device"] == "cuda" else "on the CPU"
    what = f"Memory per pipeline stage (GPipe Table 1): one training step with Adam, M = {data['chunks']}, {where}"
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--budget-mb", type=float, default=None, help="per-stage budget (default 120; smoke 8)")
    parser.add_argument("--chunks", type=int, default=8, help="M, micro-batches of the pipelines")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--max-runs", type=int, default=6, help="real runs at most per search, beyond the table's")
    parser.add_argument("--smoke", action="store_true", help="tiny models, Naive-1 and Pipeline-2, short searches")
    parser.add_argument(
        "--schedules",
        action="store_true",
        help="instead: 1F1B, ZB-H1 and interleaved 1F1B vs GPipe, the loss per micro-batch, checkpoint=never "
        "(_lib/memory_schedules.py)",
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4], metavar="K", help="K of --schedules")
    args = parser.parse_args()
    t0 = time.perf_counter()
    os.environ.update(MALLOC_ENV)  # read by glibc when the spawned workers start
    families = SMOKE if args.smoke else FAMILIES
    if args.schedules:
        return compare(args, families, [2] if args.smoke else args.ks)
    budget_mb = args.budget_mb if args.budget_mb is not None else (8.0 if args.smoke else 120.0)
    configs, notes = (["Naive-1", "Pipeline-2"] if args.smoke else list(CONFIGS)), []
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if skipped := [c for c in configs if args.device == "cuda" and CONFIGS[c] > gpus]:
        configs = [c for c in configs if c not in skipped]
        notes.append(f"Skipped ({gpus} GPU(s) visible, K > 1 needs one per stage): {', '.join(skipped)}.")
    if args.smoke:
        notes.append("Smoke run: tiny models, runs share processes (the resident-set check is then unreliable).")
    env = report.environment(threads_per_process=1, processes="one per stage, fresh for every run (gloo, 127.0.0.1)")
    print("# memory per stage:", ", ".join(f"{n} {families[n]['unit']}={families[n]['size']}" for n in args.models))
    jobs = [make_job(n, families[n], c, families[n]["size"], args) for n in args.models for c in configs]
    groups = [[j for j in jobs if CONFIGS[j["config"]] == K] for K in sorted({CONFIGS[c] for c in configs})]

    def search(name: str) -> dict[str, dict]:
        found: dict[str, dict] = {}
        spec, prev = families[name], None  # prev: (K, largest size) of the last pipeline searched
        for c in configs if not args.smoke else ["Naive-1"]:

            def runner(size: int, c: str = c) -> dict:
                return measure([make_job(name, spec, c, size, args)], args)[0]

            # K stages hold about K times the model: size^p grows about K-fold.
            seed = prev[1] * (CONFIGS[c] / prev[0]) ** (1 / spec["p"]) if prev and CONFIGS[c] > prev[0] else None
            found[c] = largest(runner, table[name, c], spec, int(budget_mb * MB), args.max_runs, seed)
            if c != "Naive-1" and found[c]["largest"]:
                prev = (CONFIGS[c], found[c]["largest"])
        return found

    # Two runs at a time: what is measured is per process, so runs may share the machine (only timing would suffer).
    with ThreadPoolExecutor(2) as pool:
        table = {(r["model"], r["config"]): r for runs in pool.map(lambda g: measure(g, args), groups) for r in runs}
        print(f"# largest size within {budget_mb:g} MB per stage", flush=True)
        found = dict(zip(args.models, pool.map(search, args.models)))
    results = {n: {"spec": families[n], "table": [table[n, c] for c in configs], "largest": found[n]} for n in found}
    runs = {id(r): r for res in results.values() for f in res["largest"].values() for r in [*res["table"], *f["runs"]]}
    pairs = [(s["peak_activation_bytes"], s["rss_peak_bytes"]) for r in runs.values() for s in r["stages"]]
    if diffs := sorted((rss - live) / MB for live, rss in pairs if rss is not None):
        ratios = [rss / live for live, rss in pairs if rss is not None and live > 10 * MB]
        big = f"; growth / peak where the peak is over 10 MB: {min(ratios):.2f} to {max(ratios):.2f}" if ratios else ""
        notes.append(
            f"Check: over the {len(diffs)} stage measurements, the resident set grew {diffs[0]:.1f} to {diffs[-1]:.1f} "
            f"MB (median {statistics.median(diffs):.1f}) more than the live-tensor peak{big}."
        )
    elapsed = time.perf_counter() - t0
    notes.append(f"Duration: {elapsed:.0f} s.")
    command = report.command_line("memory")
    md = markdown(results, env, command, budget_mb, args, notes)
    data = {"environment": env, "command": command, "budget_mb": budget_mb, "chunks": args.chunks}
    data |= {"device": args.device, "malloc_env": MALLOC_ENV, "notes": notes, "elapsed_s": elapsed}
    paths = report.write("memory", data | {"results": results}, md, out_dir=args.out_dir, plot=plot)
    print(md)
    print(f"# wrote {', '.join(paths.values())} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
