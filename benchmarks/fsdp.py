"""pp = 2 × dp: GPipeStrategy(data_parallel="fsdp") against "ddp", the bytes each rank holds and the step's time."""

# What it runs: throughput.py's Transformer T(6, 512, 4), d_model 128, vocabulary 4000 (_lib/workloads.py; its
# embeddings and vocabulary projection are layers of the backbone, so every parameter is in a stage), AdamW, the loss
# inside the pipeline (schedule "gpipe", M = 8), the global batch 64 split over the replicas, the split profiled by
# time as GPipeStrategy cuts it for "gpipe" with the loss inside. Three launches (gloo on 127.0.0.1, a thread each):
#   held  -- Trainer(strategy=GPipeStrategy(pipeline_parallel_size=2, data_parallel=...)).fit, "ddp" then "fsdp" in
#            the same processes, at pp 2 × dp 2 (4 processes) and pp 2 × dp 4 (8): after the last optimizer step of
#            each fit, every rank counts the bytes of its parameters, their gradients and AdamW's states (exp_avg,
#            exp_avg_sq, step), a DTensor by its local shard; fsdp ÷ ddp per rank. Each fit also times its steps
#            (between two barriers), the fits alternating ddp, fsdp, fsdp, ddp, ...
#   time  -- in the 4 processes, after the fits: the same model and step on the engine (GPipeStage over the same
#            (data_parallel × pipeline) mesh, AdamW), wired as the strategy wires it: "ddp" reduces the stage's
#            gradients in buckets during its last backward op (ReadyBuckets), "fsdp" shards each layer of the stage
#            (ShardedLayers: gathered at its first forward, reduce-scattered once after the drain). The two take turns
#            step by step in the same processes (machine.measure: medians of the steps no other process disturbed,
#            the ratio per round of the pair). Per step also: the all-gathers and reduce-scatters and the time the
#            rank spends blocked in them (call + wait), the visible ddp reduction, the optimizer step, and the model
#            state held at the drain (fsdp: the stage's layers gathered, their gradients not yet reduced). Each mode
#            twice: AdamW as torch picks it on the CPU (one tensor at a time) and AdamW(foreach=True). Then the
#            collectives alone: each stage's gradients as one all-reduce, a reduce-scatter per layer, an all-gather
#            per layer, every rank at once.
#   one process -- FSDP2's own cost without a peer: the whole model as one stage on one process, sharded over a
#            one-rank mesh against unsharded, by turns (--no-one-process skips it).
# Writes results/fsdp.{json,md,png}. From the repo root:
#   python -m benchmarks.fsdp

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import (
    MIN_CLEAN,
    Runner,
    Timing,
    add_timing_args,
    background_load,
    cpu_snapshot,
    free_port,
    launch,
    measure,
    paired_interval,
    paired_ratio,
    quiet_trainer,
    stats,
    wait_quiet,
)
from benchmarks._lib.workloads import (
    SIZES,
    SMOKE_SIZES,
    balances,
    build,
    describe,
    loss_fn,
    make_batch,
    per_micro_batch,
    resized,
)

MODES = ("ddp", "fsdp")
# The engine's modes: each data-parallel mode with AdamW as torch picks it on the CPU (single-tensor) and foreach.
ENGINE_MODES = ("ddp", "fsdp", "ddp, foreach", "fsdp, foreach")
ONE_PROCESS = ("plain", "fsdp, dp = 1")
PP = 2
LR = 1e-3
MB = 1e6


def kind(mode: str) -> str:
    """What an engine mode reduces with: "ddp" or "fsdp"."""
    return mode.split(",")[0]


def foreach(mode: str) -> bool | None:
    """An engine mode's AdamW(foreach=...): None lets torch choose (on the CPU, one tensor at a time)."""
    return True if mode.endswith("foreach") else None


# --------------------------------------------------------------------------------------------------- counting
def local_bytes(t: torch.Tensor) -> int:
    """What this rank holds of ``t``: a DTensor's local shard, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def held_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of ``params``, their gradients and the optimizer's states, as this rank holds them."""
    from torch.distributed.tensor import DTensor

    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    held = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "states": sum(local_bytes(t) for t in states),
        "sharded_params": sum(isinstance(p, DTensor) for p in params),
        "all_params": len(params),
    }
    held["total"] = held["params"] + held["grads"] + held["states"]
    return held


# ------------------------------------------------------------------------------------------- the Trainer fits
def lightning_module(sizes: dict[str, Any]) -> Any:
    import lightning.pytorch as pl

    class Translator(pl.LightningModule):
        """The benchmarks' Transformer as the backbone; the loss per micro-batch inside the pipeline."""

        def __init__(self) -> None:
            super().__init__()
            self.backbone = build("transformer", sizes)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            src, tgt_in, _ = batch
            return self.pipeline_loss(self.backbone((src, tgt_in)), batch)

        def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
            return loss_fn(output, batch[2])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return Translator()


def fit(mode: str, job: dict, world: int) -> dict:
    """One Trainer fit of ``job["fit_steps"]`` steps under ``data_parallel=mode``; this rank's held bytes and steps."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gpipe import GPipeStrategy

    sizes, dp = job["sizes"], world // PP
    (src, tgt_in), tgt_out = make_batch("transformer", sizes, sizes["batch"] * job["fit_steps"])
    loader = DataLoader(TensorDataset(src, tgt_in, tgt_out), batch_size=sizes["batch"] // dp)  # a replica's share

    class Probe(pl.Callback):
        """Each step between two barriers, with the CPU other processes used meanwhile (as ``machine.timed``: rank 0
        reads the machine's busy time, every rank its own); after each step, what this rank holds."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.held: dict[str, int] = {}
            self.t0 = self.c0 = self.busy0 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            dist.barrier()
            self.busy0, self.t0, self.c0 = cpu_snapshot()["busy"], time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            dist.barrier()
            wall, busy, own = time.perf_counter() - self.t0, cpu_snapshot()["busy"] - self.busy0, time.process_time()
            cpu = torch.tensor([own - self.c0, busy if dist.get_rank() == 0 else 0.0], dtype=torch.float64)
            dist.all_reduce(cpu)
            foreign = max(float(cpu[1] - cpu[0]), 0.0) / wall
            self.steps.append({"ms": wall * 1e3, "foreign_cores": foreign, "clean": foreign < job["clean_threshold"]})
            self.held = held_bytes(list(module.parameters()), trainer.optimizers[0])

    probe = Probe()
    strategy = GPipeStrategy(
        chunks=job["chunks"],
        pipeline_parallel_size=PP,
        balance=job["balance"],
        schedule="gpipe",
        data_parallel=mode,
    )
    trainer = quiet_trainer(world, strategy, job["fit_steps"], [probe], job["dir"])
    torch.manual_seed(0)
    trainer.fit(lightning_module(sizes), loader)
    # Which stage of which replica this rank was: the rank layout depends on the mode (GPipeStrategy(layout="auto")).
    where = {"stage": strategy.stage.index, "replica": strategy.device_mesh["data_parallel"].get_local_rank()}
    where |= {"rank": dist.get_rank(), "rank_layout": strategy.layout}
    return {"held": probe.held | where, "steps": probe.steps}


def as_torchrun(rank: int, world: int) -> None:
    """The environment torchrun gives a rank: Lightning's Trainer then starts no processes of its own and uses the
    process group ``launch`` made."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),  # read, not used: the group exists already
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="benchmarks.fsdp",
    )


def fits(rank: int, world: int, job: dict) -> dict:
    """The Trainer fits by turns (ddp, fsdp, fsdp, ddp, ...): per mode, every rank's held bytes and step times."""
    warnings.filterwarnings("ignore")
    as_torchrun(rank, world)
    out: dict[str, Any] = {mode: {"held": None, "steps": []} for mode in MODES}
    for r in range(job["fit_rounds"]):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            got = fit(mode, job, world)
            held: list[Any] = [None] * world
            dist.all_gather_object(held, got["held"])
            out[mode]["held"] = held
            out[mode]["steps"].append(got["steps"])  # the same on every rank (between barriers): rank 0's
    return out


# ------------------------------------------------------------------------------------------ the engine, timed
class Collectives:
    """Counts ``dist.all_gather_single`` and ``reduce_scatter_single`` calls (FSDP2's) and the time this rank spends
    in them: the call, and the wait on its work when it is asynchronous."""

    NAMES = ("all_gather_single", "reduce_scatter_single")

    def __init__(self) -> None:
        self.calls = dict.fromkeys(self.NAMES, 0)
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.real = {name: getattr(dist, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(dist, name, self._counted(name))

    def _counted(self, name: str) -> Callable[..., Any]:
        real = self.real[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            t0 = time.perf_counter()
            work = real(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            if isinstance(work, dist.Work):
                work = _TimedWork(work, lambda seconds: self.seconds.__setitem__(name, self.seconds[name] + seconds))
            return work

        return call

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        return dict(self.calls), dict(self.seconds)

    def close(self) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)


class _TimedWork(dist.Work):
    """An asynchronous collective's work whose ``wait`` adds the time blocked in it (FSDP2 waits on a ``Work``)."""

    def __init__(self, work: dist.Work, add: Callable[[float], None]) -> None:
        super().__init__()
        self.work, self.add = work, add

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.perf_counter()
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        finally:
            self.add(time.perf_counter() - t0)


def model_state_at_drain(params: list[nn.Parameter]) -> int:
    """Bytes of the stage's parameters and gradients as the module holds them at its drain (fsdp: gathered)."""
    return sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)


def engine_timing(rank: int, world: int, job: dict) -> dict:
    """ddp and fsdp steps by turns on the engine, in these processes; per mode the step times and what else each
    step did (collectives, the visible reduction, the optimizer, the model state at the drain)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.pipe.dp.fsdp import ShardedLayers
    from lightning_gpipe.pipe.dp.ready_buckets import ReadyBuckets

    sizes, dp = job["sizes"], world // PP
    mesh = init_device_mesh("cpu", (dp, PP), mesh_dim_names=("data_parallel", "pipeline"))
    pp_group, dp_group = mesh["pipeline"].get_group(), mesh["data_parallel"].get_group()
    d = mesh["data_parallel"].get_local_rank()
    (src, tgt_in), tgt_out = make_batch("transformer", sizes)
    share = sizes["batch"] // dp
    x = (src[d * share : (d + 1) * share], tgt_in[d * share : (d + 1) * share])
    y = tgt_out[d * share : (d + 1) * share]
    stages = {
        mode: GPipeStage(build("transformer", sizes), chunks=job["chunks"], balance=job["balance"], group=pp_group)
        for mode in ENGINE_MODES
    }
    # Each mode its own stage, optimizer and reduction; "foreach": AdamW(foreach=True) (off CUDA torch's is False).
    sharded = {m: ShardedLayers(stages[m].children(), mesh["data_parallel"]) for m in ENGINE_MODES if kind(m) == "fsdp"}
    optimizers = {m: torch.optim.AdamW(stages[m].parameters(), lr=LR, foreach=foreach(m)) for m in ENGINE_MODES}
    bucket = int(job["bucket_mb"] * 2**20)
    ready = {m: ReadyBuckets(list(stages[m].parameters()), dp_group, bucket) for m in ENGINE_MODES if kind(m) == "ddp"}
    collectives = Collectives()
    extra: dict[str, list[dict]] = {mode: [] for mode in ENGINE_MODES}

    def step(mode: str) -> Callable[[], Any]:
        stage, optimizer = stages[mode], optimizers[mode]

        def run() -> float | None:
            calls0, seconds0 = collectives.snapshot()
            record: dict[str, float] = {}
            pending: list[Any] = []
            loss = per_micro_batch(loss_fn, y, stage.micro_batch_sizes(x))

            def drained() -> None:
                record["state_at_drain"] = model_state_at_drain(list(stage.parameters()))
                t0 = record["drain_s"] = time.perf_counter()  # one clock for every process of this host
                if kind(mode) == "fsdp":
                    sharded[mode].reduce()
                else:
                    pending.append(ready[mode].launch_rest())
                record["reduced_s"] = time.perf_counter()
                record["reduce_launch_ms"] = (record["reduced_s"] - t0) * 1e3

            if kind(mode) == "fsdp":
                sharded[mode].begin()
                hooks: dict[str, Any] = {"drained": drained}
            else:
                hooks = {"before_last_backward": ready[mode].arm, "drained": drained}
            losses = stage.forward_backward(x if stage.is_first else None, loss, schedule="gpipe", **hooks)
            t0 = time.perf_counter()
            for p in pending:
                p.wait()
                record["reduced_s"] = time.perf_counter()
            record["reduce_wait_ms"] = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            optimizer.step()
            record["optimizer_ms"] = (time.perf_counter() - t0) * 1e3
            calls1, seconds1 = collectives.snapshot()
            for name in Collectives.NAMES:
                record[f"{name}_calls"] = calls1[name] - calls0[name]
                record[f"{name}_ms"] = (seconds1[name] - seconds0[name]) * 1e3
            extra[mode].append(record)
            return torch.stack(losses).sum().item() if stage.is_last else None

        return run

    runners = {m: Runner(lambda m=m: optimizers[m].zero_grad(set_to_none=True), step(m)) for m in ENGINE_MODES}
    try:
        measured = measure(runners, Timing(**job["timing"]))
    finally:
        collectives.close()
    held = {mode: held_bytes(list(stages[mode].parameters()), optimizers[mode]) for mode in ENGINE_MODES}
    # Each sharded layer's elements, padded as FSDP2 pads them (dim 0 to a multiple of dp).
    layer_numels = [
        sum(
            -(-p.shape[0] // dp) * dp * (p.numel() // max(p.shape[0], 1)) if p.dim() else p.numel()
            for p in unit.parameters()
        )
        for unit in sharded["fsdp"].units
    ]
    alone = collectives_alone(layer_numels, dp_group, job["collective_repeats"])
    per_rank: list[Any] = [None] * world
    units = len(sharded["fsdp"].units)
    got = {"extra": extra, "held": held, "units": units, "layer_numels": layer_numels, "alone": alone}
    dist.all_gather_object(per_rank, got)
    return {"records": measured.records, "first": measured.first, "paused_s": measured.paused_s, "per_rank": per_rank}


def collectives_alone(numels: list[int], group: dist.ProcessGroup, repeats: int) -> dict[str, float]:
    """The stage's gradients reduced over ``group`` outside a step, every rank at once (ms, medians over ``repeats``):
    one all-reduce of all of it (ddp's one bucket), a reduce-scatter per layer one after the other (FSDP2's, each
    waited for), an all-gather per layer (the gathers of a step)."""
    dp = dist.get_world_size(group)
    grads = [torch.randn(n) for n in numels]
    flat = torch.cat(grads)
    shards = [torch.empty(n // dp) for n in numels]

    def all_reduce() -> None:
        dist.all_reduce(flat, group=group)

    def reduce_scatter() -> None:
        for g, out in zip(grads, shards, strict=True):
            dist.reduce_scatter_single(out, g, group=group)

    def all_gather() -> None:
        for g, out in zip(grads, shards, strict=True):
            dist.all_gather_single(g, out, group=group)

    times: dict[str, list[float]] = {"all_reduce": [], "reduce_scatter": [], "all_gather": []}
    for _ in range(repeats):
        for name, fn in (("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter), ("all_gather", all_gather)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()} | {"mb": flat.numel() * 4 / MB}


def one_process(rank: int, world: int, job: dict) -> dict:
    """FSDP2's own cost, without a peer: the whole model as one stage (K = 1) on one process, its layers sharded over a
    one-rank mesh (dp = 1: every gather and reduce-scatter a local copy) against the same stage unsharded, by turns;
    one replica's batch of pp 2 × dp 2. Per step, forward + backward (+ ``ShardedLayers.reduce``) and AdamW apart."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.pipe.dp.fsdp import ShardedLayers

    warnings.filterwarnings("ignore")
    sizes = job["sizes"]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    x, y = make_batch("transformer", sizes, sizes["batch"] // 2)
    stages = {mode: GPipeStage(build("transformer", sizes), chunks=job["chunks"]) for mode in ONE_PROCESS}
    sharded = ShardedLayers(stages["fsdp, dp = 1"].children(), mesh)
    optimizers = {mode: torch.optim.AdamW(stage.parameters(), lr=LR) for mode, stage in stages.items()}
    parts: dict[str, list[dict]] = {mode: [] for mode in ONE_PROCESS}

    def step(mode: str) -> Callable[[], Any]:
        stage, optimizer = stages[mode], optimizers[mode]
        fsdp = mode != "plain"

        def run() -> float:
            loss = per_micro_batch(loss_fn, y, stage.micro_batch_sizes(x))
            t0 = time.perf_counter()
            if fsdp:
                sharded.begin()
            losses = stage.forward_backward(x, loss, schedule="gpipe", drained=sharded.reduce if fsdp else None)
            t1 = time.perf_counter()
            optimizer.step()
            parts[mode].append({"fwd_bwd_ms": (t1 - t0) * 1e3, "optimizer_ms": (time.perf_counter() - t1) * 1e3})
            return torch.stack(losses).sum().item()

        return run

    runners = {m: Runner(lambda m=m: optimizers[m].zero_grad(set_to_none=True), step(m)) for m in ONE_PROCESS}
    measured = measure(runners, Timing(**job["timing"]))
    return {"records": measured.records, "first": measured.first, "parts": parts}


# ---------------------------------------------------------------------------------------------------- the jobs
def run_job(rank: int, world: int, job: dict) -> dict:
    out = {"fits": fits(rank, world, job)}
    if job["time"]:
        out["engine"] = engine_timing(rank, world, job)
    return out


# ----------------------------------------------------------------------------------------------------- tables
HELD_COLUMNS = [
    ("layout", "pp × dp", ""),
    ("replica", "replica", "d"),
    ("stage", "stage", "d"),
    ("ranks", "global rank: ddp / fsdp", ""),
    ("ddp_mb", "ddp: params + grads + states (MB)", ".2f"),
    ("fsdp_params_mb", "fsdp: params (MB)", ".2f"),
    ("fsdp_grads_mb", "grads (MB)", ".2f"),
    ("fsdp_states_mb", "AdamW states (MB)", ".2f"),
    ("fsdp_mb", "fsdp: total (MB)", ".2f"),
    ("ratio", "fsdp ÷ ddp", ".3f"),
    ("sharded", "parameters sharded", ""),
]
SUMMARY_COLUMNS = [
    ("layout", "pp × dp", ""),
    ("max_ratio", "fsdp ÷ ddp, worst rank", ".3f"),
    ("ratio_of_max", "max over ranks: fsdp ÷ ddp", ".3f"),
    ("ideal", "1 / dp", ".3f"),
    ("target", "target", ""),
    ("met", "met", ""),
]
TIME_COLUMNS = [
    ("mode", "mode", ""),
    ("median_ms", "step (ms)", ".1f"),
    ("min_ms", "min", ".1f"),
    ("max_ms", "max", ".1f"),
    ("clean", "clean / timed steps", ""),
    ("ratio", "÷ ddp, paired", ".3f"),
    ("interval", "95 % interval", ""),
    ("ratio_all", "÷ ddp, every round", ".3f"),
    ("interval_all", "95 % interval", ""),
    ("gathers", "all-gathers / step (per layer)", ""),
    ("scatters", "reduce-scatters / step (per layer)", ""),
    ("gather_ms", "blocked in all-gathers (ms)", ".1f"),
    ("reduce_ms", "reduction after the drain (ms)", ".1f"),
    ("optimizer_ms", "AdamW step (ms)", ".1f"),
    ("drain_mb", "params + grads at the drain (MB)", ".2f"),
]
ALONE_COLUMNS = [
    ("stage", "stage", "d"),
    ("layers", "sharded layers", "d"),
    ("mb", "gradients (MB)", ".2f"),
    ("all_reduce", "one all-reduce (ms)", ".1f"),
    ("reduce_scatter", "a reduce-scatter per layer (ms)", ".1f"),
    ("all_gather", "an all-gather per layer (ms)", ".1f"),
    ("in_step_fsdp", "in the step: ShardedLayers.reduce (ms)", ".1f"),
    ("in_step_ddp", "in the step: ddp's wait after the drain (ms)", ".1f"),
    ("skew_free_fsdp", "fsdp: from both replicas' drain to reduced (ms)", ".1f"),
    ("skew_free_ddp", "ddp: the same (ms)", ".1f"),
]
FIT_COLUMNS = [
    ("layout", "pp × dp", ""),
    ("mode", "mode", ""),
    ("fits", "fits", "d"),
    ("median_ms", "step (ms), median", ".1f"),
    ("spread", "min–max", ""),
    ("clean", "clean / timed steps", ""),
    ("noisy", "noisy (median of all steps)", ""),
    ("ratio", "÷ ddp", ".3f"),
]
TARGETS = {2: 0.55, 4: 0.30}


def layout(dp: int) -> str:
    return f"pp {PP} × dp {dp}"


def held_rows(results: dict) -> tuple[list[dict], list[dict]]:
    rows, summary = [], []
    for dp, result in results.items():
        ddp, fsdp = result["fits"]["ddp"]["held"], result["fits"]["fsdp"]["held"]
        # The same stage of the same replica in both fits (the two modes lay the ranks out differently).
        fsdp_at = {(b["stage"], b["replica"]): b for b in fsdp}
        for a in sorted(ddp, key=lambda h: (h["replica"], h["stage"])):
            b = fsdp_at[a["stage"], a["replica"]]
            rows.append(
                {
                    "layout": layout(dp),
                    "replica": a["replica"],
                    "stage": a["stage"],
                    "ranks": f"{a['rank']} / {b['rank']}",
                    "ddp_mb": a["total"] / MB,
                    "fsdp_params_mb": b["params"] / MB,
                    "fsdp_grads_mb": b["grads"] / MB,
                    "fsdp_states_mb": b["states"] / MB,
                    "fsdp_mb": b["total"] / MB,
                    "ratio": b["total"] / a["total"],
                    "sharded": f"{b['sharded_params']} of {b['all_params']}",
                }
            )
        worst = max(r["ratio"] for r in rows if r["layout"] == layout(dp))
        target = TARGETS.get(dp)
        summary.append(
            {
                "layout": layout(dp),
                "max_ratio": worst,
                "ratio_of_max": max(b["total"] for b in fsdp) / max(a["total"] for a in ddp),
                "ideal": 1 / dp,
                "target": f"≤ {target:.2f}" if target else "–",
                "met": ("yes" if worst <= target else "no") if target else "–",
            }
        )
    return rows, summary


def _median_over_steps(extra: list[list[dict]], key: str, warmup: int) -> float:
    """Per timed step the worst rank's value, then the median over the steps."""
    steps = len(extra[0])
    return statistics.median(max(rank[s][key] for rank in extra) for s in range(warmup, steps))


def per_layer(extra: list[list[dict]], units: list[int], name: str, warmup: int) -> str:
    """The calls to ``name`` a timed step made on a rank, and per sharded layer of the rank: "3/4 (1)"."""
    counts = sorted({step[f"{name}_calls"] for rank in extra for step in rank[warmup:]})
    if counts == [0]:
        return "0"
    ratios = {step[f"{name}_calls"] / u for rank, u in zip(extra, units, strict=True) for step in rank[warmup:]}
    return f"{'/'.join(map(str, counts))} ({'/'.join(f'{x:g}' for x in sorted(ratios))})"


def time_rows(engine: dict, warmup: int) -> list[dict]:
    records, per_rank = engine["records"], engine["per_rank"]
    units = [r["units"] for r in per_rank]
    rows = []
    for mode in records:
        s = stats(records[mode], 1)
        extra = [r["extra"][mode] for r in per_rank]
        base = "ddp" + mode.removeprefix(kind(mode))  # the ddp mode with the same AdamW
        pair = (records[mode], records[base])
        interval = paired_interval(*pair) if mode != base else None
        every = tuple([{**r, "clean": True} for r in recs] for recs in pair)  # disturbed rounds too
        interval_all = paired_interval(*every) if mode != base else None
        reduce_key = "reduce_launch_ms" if kind(mode) == "fsdp" else "reduce_wait_ms"
        rows.append(
            {
                "mode": mode,
                "median_ms": s["median_ms"],
                "min_ms": s["min_ms"],
                "max_ms": s["max_ms"],
                "clean": f"{s['clean_steps']} / {s['timed_steps']}",
                "noisy": s["noisy"],
                "ratio": paired_ratio(*pair) if mode != base else 1.0,
                "interval": f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else "",
                "ratio_all": paired_ratio(*every) if mode != base else 1.0,
                "interval_all": f"{interval_all[0]:.3f}–{interval_all[1]:.3f}" if interval_all else "",
                "gathers": per_layer(extra, units, "all_gather_single", warmup),
                "scatters": per_layer(extra, units, "reduce_scatter_single", warmup),
                "gather_ms": _median_over_steps(extra, "all_gather_single_ms", warmup),
                "scatter_ms": _median_over_steps(extra, "reduce_scatter_single_ms", warmup),
                "reduce_ms": _median_over_steps(extra, reduce_key, warmup),
                "optimizer_ms": _median_over_steps(extra, "optimizer_ms", warmup),
                "drain_mb": max(rank[0]["state_at_drain"] for rank in extra) / MB,
            }
        )
    return rows


def _after_both_drained(extra: list[list[dict]], warmup: int) -> float:
    """Per timed step, from the last drain among a stage's replicas to the end of their reduction (ms): the reduction
    without the skew between the replicas (no replica can finish before the other's gradients exist); medians."""
    steps = len(extra[0])
    return statistics.median(
        (max(rank[s]["reduced_s"] for rank in extra) - max(rank[s]["drain_s"] for rank in extra)) * 1e3
        for s in range(warmup, steps)
    )


def alone_rows(engine: dict, warmup: int) -> list[dict]:
    """Per stage, the worst of its ranks: the collectives alone, and the reduction after the drain in the step."""
    per_rank = engine["per_rank"]
    rows = []
    for stage in range(PP):
        ranks = [r for i, r in enumerate(per_rank) if i % PP == stage]
        row: dict[str, Any] = {"stage": stage, "layers": ranks[0]["units"], "mb": ranks[0]["alone"]["mb"]}
        for name in ("all_reduce", "reduce_scatter", "all_gather"):
            row[name] = max(r["alone"][name] for r in ranks)
        row["in_step_fsdp"] = _median_over_steps([r["extra"]["fsdp"] for r in ranks], "reduce_launch_ms", warmup)
        row["in_step_ddp"] = _median_over_steps([r["extra"]["ddp"] for r in ranks], "reduce_wait_ms", warmup)
        for mode in MODES:
            row[f"skew_free_{mode}"] = _after_both_drained([r["extra"][mode] for r in ranks], warmup)
        rows.append(row)
    return rows


ONE_COLUMNS = [
    ("mode", "mode", ""),
    ("median_ms", "step (ms)", ".1f"),
    ("clean", "clean / timed steps", ""),
    ("ratio", "÷ plain, paired", ".3f"),
    ("interval", "95 % interval", ""),
    ("ratio_all", "÷ plain, every round", ".3f"),
    ("fwd_bwd_ms", "forward + backward (+ reduce) (ms)", ".1f"),
    ("fwd_bwd_ratio", "÷ plain", ".3f"),
    ("optimizer_ms", "AdamW step (ms)", ".1f"),
    ("optimizer_ratio", "÷ plain", ".3f"),
]


def one_process_rows(one: dict, warmup: int) -> list[dict]:
    records, parts = one["records"], one["parts"]
    rows = []
    for mode in ONE_PROCESS:
        s = stats(records[mode], 1)
        pair = (records[mode], records["plain"])
        every = tuple([{**r, "clean": True} for r in recs] for recs in pair)
        interval = paired_interval(*pair) if mode != "plain" else None
        row = {
            "mode": mode,
            "median_ms": s["median_ms"],
            "clean": f"{s['clean_steps']} / {s['timed_steps']}",
            "ratio": paired_ratio(*pair) if mode != "plain" else 1.0,
            "interval": f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else "",
            "ratio_all": paired_ratio(*every) if mode != "plain" else 1.0,
        }
        for key in ("fwd_bwd_ms", "optimizer_ms"):
            row[key] = statistics.median(p[key] for p in parts[mode][warmup:])
            base = statistics.median(p[key] for p in parts["plain"][warmup:])
            row[key.replace("_ms", "_ratio")] = row[key] / base
        rows.append(row)
    return rows


def fit_rows(results: dict) -> list[dict]:
    """Per layout and mode, the Trainer's steps (each fit's first left out: it warms up): the median of the clean
    ones when there are ``MIN_CLEAN``, else of all (``noisy``)."""
    rows = []
    for dp, result in results.items():
        for mode in MODES:
            steps = [st for fit in result["fits"][mode]["steps"] for st in fit[1:]]
            clean = [st["ms"] for st in steps if st["clean"]]
            use = clean if len(clean) >= MIN_CLEAN else [st["ms"] for st in steps]
            rows.append(
                {
                    "layout": layout(dp),
                    "mode": mode,
                    "fits": len(result["fits"][mode]["steps"]),
                    "median_ms": statistics.median(use),
                    "spread": f"{min(use):.0f}–{max(use):.0f}",
                    "clean": f"{len(clean)} / {len(steps)}",
                    "noisy": "yes" if len(clean) < MIN_CLEAN else "no",
                }
            )
        base = rows[-len(MODES)]["median_ms"]
        for r in rows[-len(MODES) :]:
            r["ratio"] = r["median_ms"] / base
    return rows


def plot(data: dict) -> Any:
    """Held bytes per rank (ddp against fsdp, each layout) and the engine's step time per mode, broken down."""
    fig, axes = report.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 1.8]})
    ax = axes[0][0]
    rows = data["held"]
    labels = [f"{r['layout'].replace('pp 2 × ', '')}\nd {r['replica']}, k {r['stage']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ddp_mb"] for r in rows], width=0.4, label="ddp", color="tab:gray")
    bottom = [0.0] * len(rows)
    for key, label, color in (
        ("fsdp_params_mb", "fsdp: parameters", "tab:blue"),
        ("fsdp_grads_mb", "fsdp: gradients", "tab:orange"),
        ("fsdp_states_mb", "fsdp: AdamW states", "tab:green"),
    ):
        values = [r[key] for r in rows]
        ax.bar([x + 0.2 for x in xs], values, width=0.4, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, r["fsdp_mb"], f"{r['ratio']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(
        xlabel="pp 2 × dp, stage k of replica d",
        ylabel="held after an optimizer step (MB)",
        title="bytes per rank (fsdp ÷ ddp above the bars)",
    )
    report.legend_right(ax)
    ax = axes[0][1]
    times = data["time"]
    if times:
        names = [r["mode"].replace(", ", "\n") for r in times]
        parts = (
            ("gather_ms", "blocked in all-gathers", "tab:purple"),
            ("reduce_ms", "reduction after the drain", "tab:red"),
            ("optimizer_ms", "AdamW step", "tab:green"),
        )
        bottom = [0.0] * len(times)
        for key, label, color in parts:
            values = [r[key] for r in times]
            ax.bar(names, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        rest = [max(r["median_ms"] - b, 0.0) for r, b in zip(times, bottom, strict=True)]
        ax.bar(names, rest, bottom=bottom, label="the rest of the step", color="tab:gray", alpha=0.5)
        for name, r in zip(names, times, strict=True):
            ax.text(name, r["median_ms"], f"{r['ratio']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set(
            xlabel="mode (AdamW as torch picks it on the CPU, or foreach)",
            ylabel="step (ms), medians",
            title="pp 2 × dp 2, the engine, by turns\n(÷ ddp with the same AdamW above)",
        )
        report.legend_right(ax)
    job = data["job"]
    what = (
        "GPipeStrategy(data_parallel='fsdp') against 'ddp': AdamW, the loss inside the pipeline (gpipe), "
        f"M = {job['chunks']}\n{data['model']}"
    )
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dps", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (2: also timed)")
    parser.add_argument("--chunks", type=int, default=8, metavar="M")
    parser.add_argument("--fit-steps", type=int, default=6, help="optimizer steps per Trainer fit")
    parser.add_argument("--fit-rounds", type=int, default=2, help="Trainer fits per mode at dp = 2 (by turns)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ddp's buckets (GPipeStrategy's default)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=INT", help="size changes, e.g. d_model=256")
    parser.add_argument(
        "--no-one-process", dest="one_process", action="store_false", help="skip FSDP2's cost on one process"
    )
    add_timing_args(parser)
    parser.set_defaults(max_steps=30)  # four processes on two cores: room for 10 clean rounds on a shared machine
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny Transformer, one fit a mode, 5 steps, no waits")
    args = parser.parse_args()
    t_start = time.perf_counter()
    sizes = resized(SMOKE_SIZES if args.smoke else SIZES, args.set)["transformer"]
    if args.smoke:
        args.fit_steps, args.fit_rounds = 2, 1
        timing = Timing(steps=5, max_steps=5, warmup=1, clean_threshold=float("inf"), wait_quiet=0.0)
    else:
        timing = Timing.from_args(parser, args)
    if any(dp < 1 or sizes["batch"] % dp for dp in args.dps):
        parser.error(f"every --dps must divide the global batch {sizes['batch']}")
    info = balances("transformer", sizes, [PP], "time", args.chunks)
    balance = info["balance"][PP]
    model = f"{describe('transformer', sizes)}; {info['parameters'] / 1e6:.2f}M parameters, balance {balance}"
    print(f"# {model}", flush=True)
    env = report.environment(threads_per_process=1, processes=" and ".join(f"{PP * dp}" for dp in args.dps))
    results: dict[int, Any] = {}
    launches: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dps:
            waited = wait_quiet(timing.wait_quiet, timing.clean_threshold)
            job = {
                "sizes": sizes,
                "chunks": args.chunks,
                "balance": balance,
                "fit_steps": args.fit_steps,
                "fit_rounds": args.fit_rounds if dp == 2 else 1,
                "bucket_mb": args.bucket_mb,
                "collective_repeats": 2 if args.smoke else 7,
                "timing": dataclasses.asdict(timing),
                "clean_threshold": timing.clean_threshold,
                "time": dp == 2,
                "dir": tmp,
            }
            load_before, snap, t0 = os.getloadavg(), cpu_snapshot(), time.perf_counter()
            results[dp] = launch(run_job, PP * dp, job)
            background, line = background_load(snap, load_before)
            launches[dp] = {"job": job, "seconds": time.perf_counter() - t0, "waited_s": waited, "load": background}
            print(f"# {layout(dp)}: {launches[dp]['seconds']:.0f} s; {line.removeprefix('# ')}", flush=True)
        one = None
        if args.one_process:
            wait_quiet(timing.wait_quiet, timing.clean_threshold)
            t0 = time.perf_counter()
            one = launch(one_process, 1, {"sizes": sizes, "chunks": args.chunks, "timing": dataclasses.asdict(timing)})
            print(f"# one process: {time.perf_counter() - t0:.0f} s", flush=True)
    held, summary = held_rows(results)
    single = one_process_rows(one, timing.warmup) if one else []
    engine = results[2]["engine"] if 2 in results else None
    times = time_rows(engine, timing.warmup) if engine else []
    alone = alone_rows(engine, timing.warmup) if engine else []
    trainer_times = fit_rows(results)
    total = time.perf_counter() - t_start
    command = report.command_line("fsdp")
    md = [
        '# GPipeStrategy(data_parallel="fsdp") against "ddp": bytes held per rank and the step\'s time',
        "",
        *report.environment_lines(env),
        f"- Command: `{command}`; total {total:.0f} s",
        f"- Model: {model}; AdamW; the loss inside the pipeline (pipeline_loss, schedule gpipe), M = {args.chunks}; "
        f"global batch {sizes['batch']}, {sizes['batch']} / dp samples a replica",
        *[
            f"- {layout(dp)} launch: {launches[dp]['seconds']:.0f} s; other processes used "
            f"{launches[dp]['load']['during_run']['foreign_cores']:.2f} cores on average meanwhile"
            for dp in args.dps
        ],
        "",
        "## Bytes held per rank after an optimizer step (Trainer.fit)",
        "",
        f"Trainer(strategy=GPipeStrategy(pipeline_parallel_size=2, data_parallel=...)).fit, {args.fit_steps} steps; "
        "after the last, each rank's parameters, their gradients and AdamW's states (exp_avg, exp_avg_sq, step), a "
        "DTensor counted by its local shard (`to_local()`); each against the same stage of the same replica in the "
        "ddp fit (GPipeStrategy's default rank layouts differ: ddp's stages_together, rank d·K + k; fsdp's "
        "replicas_together, rank k·D + d).",
        "",
        report.markdown_table(summary, SUMMARY_COLUMNS),
        "",
        report.markdown_table(held, HELD_COLUMNS),
    ]
    if times:
        fsdp_row = next(r for r in times if r["mode"] == "fsdp")
        md += [
            "",
            "## Step time, pp 2 × dp 2 (the engine, by turns step by step)",
            "",
            "GPipeStage over the same mesh (rank d·K + k) and split, AdamW as torch picks it on the CPU (one tensor "
            "at a time) or with `foreach=True` (the modes ending in ', foreach'; each ÷ ddp with the same AdamW); ddp: "
            "ReadyBuckets (the stage's buckets of "
            f"{args.bucket_mb:g} MiB reduced during its last backward op, as the strategy does); fsdp: ShardedLayers "
            "(gathered at its first forward, reduce-scattered once after the drain). Step = forward + loss + backward "
            "+ reduction + AdamW, between two barriers, the slowest rank; medians of the clean steps "
            f"(`_lib/machine.py`); ÷ ddp: the median over rounds of fsdp's step ÷ ddp's of the same round, with its "
            "95 % interval. Per step, the worst rank's time blocked in FSDP2's all-gathers (call + wait), "
            "in the reduction after the drain (fsdp: `ShardedLayers.reduce`, the reduce-scatters and resharding; "
            "ddp: the wait on the buckets still in flight), in AdamW's step; medians over the steps. "
            "Collectives per step: per rank (per sharded layer). First losses: "
            + "; ".join(f"{m}: {engine['first'][m]:.6f}" for m in ENGINE_MODES),
            "",
            report.markdown_table(times, TIME_COLUMNS),
            "",
            f"fsdp's reduce-scatters within that reduction: {fsdp_row['scatter_ms']:.1f} ms a step.",
            "",
            "### The collectives alone (pp 2 × dp 2, after the timed steps)",
            "",
            "Each rank's stage gradients (the sharded layers' elements, padded as FSDP2 pads them) reduced over its "
            "replicas outside a step, every rank at once: one all-reduce of all of it (ddp's one 25 MiB bucket), a "
            "reduce-scatter per layer one after the other (as `ShardedLayers.reduce` issues them), an all-gather per "
            f"layer; medians of {2 if args.smoke else 7}, the worst rank of each stage; beside them, the same stage's "
            "reduction after the drain inside the timed steps (medians): on the rank, and from the later of the two "
            "replicas' drains to the end of both reductions (the skew between the replicas left out; one clock). "
            "ddp's end is taken once `forward_backward` has returned, which on the last stage waits for the first "
            "stage's drain: its last-stage figure is that wait, not its reduction.",
            "",
            report.markdown_table(alone, ALONE_COLUMNS),
        ]
    if single:
        md += [
            "",
            "### FSDP2's own cost, on one process",
            "",
            "The whole model as one stage (K = 1, M = "
            f"{args.chunks}) on one process, one replica's batch ({sizes['batch'] // 2} samples): its layers sharded "
            "over a one-rank mesh (dp = 1: every all-gather and reduce-scatter a local copy) against the same stage "
            "unsharded, by turns step by step; the step and its two parts, medians.",
            "",
            report.markdown_table(single, ONE_COLUMNS),
        ]
    md += [
        "",
        "## Step time through the Trainer (fits back to back in the same processes)",
        "",
        "Each fit's steps between two barriers (its first step left out: it warms up), clean when other processes "
        "used under the threshold of cores meanwhile (as the engine's); per layout and mode the median of the clean "
        f"steps (of all, where under {MIN_CLEAN} were clean: noisy); at dp 2 the fits take turns ddp, fsdp, fsdp, "
        "ddp.",
        "",
        report.markdown_table(trainer_times, FIT_COLUMNS),
    ]
    data = {
        "command": command,
        "environment": env,
        "model": model,
        "job": {"chunks": args.chunks, "dps": args.dps, "timing": dataclasses.asdict(timing), "balance": balance},
        "balance": info,
        "launches": launches,
        "held": held,
        "held_summary": summary,
        "time": times,
        "collectives_alone": alone,
        "one_process": single,
        "trainer_time": trainer_times,
        "raw": results,
        "raw_one_process": one,
        "total_s": total,
    }
    paths = report.write("fsdp", data, "\n".join(md), out_dir=args.out_dir, plot=plot)
    print("\n".join(md))
    print(f"# wrote {', '.join(paths.values())} ({total:.0f} s)")


if __name__ == "__main__":
    main()
