"""The cost model's measurements inside the K-process launch: each rank's one-stage pipelines; a traced step by kind."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib.costmodel import LayerCosts, Prediction, engine_factor
from benchmarks._lib.machine import Runner, Timing, pause_until_quiet, timed
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe._torch_internals import tree_flatten
from lightning_gpipe.pipe.executor import Checkpoint

LossFn = Callable[[Any, int], torch.Tensor]


def stage_input(model: nn.Sequential, x: Any, start: int) -> Any:
    """What layer ``start`` of ``model`` gets in a step: ``x`` through the layers before it (no grad)."""
    with torch.no_grad():
        for layer in list(model)[:start]:
            x = layer(x)
    return x


def sum_loss(y: Any, m: int) -> torch.Tensor:
    """A stage that is not the last gets an output gradient; alone, it back-propagates the sum of its outputs."""
    return sum(t.sum() for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor) and t.requires_grad)  # type: ignore[return-value]


def one_stage_time(
    layers: nn.Sequential, x: Any, loss: LossFn, M: int, checkpoint: Checkpoint, steps: int, group: Any = None
) -> float:
    """The median forward_backward of a one-stage pipeline of ``layers`` on ``x`` (M micro-batches), after one
    untimed step; ``group``: a group of this rank alone, where torch.distributed runs."""
    stage = GPipeStage(layers, chunks=M, balance=[len(layers)], checkpoint=checkpoint, group=group)
    times = []
    for i in range(steps + 1):
        stage.zero_grad(set_to_none=True)
        start = time.perf_counter()
        stage.forward_backward(x, loss)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_stage_times(
    build: Callable[[], nn.Sequential],
    x: Any,
    loss: LossFn,
    balance: list[int],
    v: int,
    M: int,
    steps: int,
    timing: Timing,
) -> list[dict[str, Any]]:
    """A collective: every stage of the vK (``balance``) as a one-stage pipeline of its layers, in the process of the
    rank that holds it, timed while every rank times its own (``corun_s``) and alone, rank by rank (``alone_s``: the
    others wait in a barrier, which uses no CPU). Checkpoint "always" but on the last stage ("except_last"), so that
    each runs the kinds of actions it runs in a step. ``x``: the model's input (the global batch), ``loss``: the last
    stage's per micro-batch. Every rank gets every stage's row."""
    rank, K = dist.get_rank(), dist.get_world_size()
    single = [dist.new_group([r]) for r in range(K)][rank]  # every rank makes every group, in one order
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    mine = []
    for c in range(v):
        s = c * K + rank
        model = build()
        last = s == len(balance) - 1
        checkpoint: Checkpoint = "except_last" if last else "always"
        layers = nn.Sequential(*list(model)[bounds[s] : bounds[s + 1]])
        mine.append((s, checkpoint, layers, stage_input(model, x, bounds[s]), loss if last else sum_loss))

    def run() -> list[float]:
        return [one_stage_time(copy.deepcopy(part), xs, f, M, ck, steps, single) for _, ck, part, xs, f in mine]

    pause_until_quiet(timing.wait_quiet / 4, timing.clean_threshold)
    corun = run()
    alone: list[float] = []
    for r in range(K):
        pause_until_quiet(timing.wait_quiet / 4, timing.clean_threshold)
        if r == rank:
            alone = run()
        dist.barrier()
    rows = [
        {"stage": s, "layers": [bounds[s], bounds[s + 1]], "checkpoint": ck, "corun_s": t, "alone_s": a}
        for (s, ck, *_), t, a in zip(mine, corun, alone, strict=True)
    ]
    gathered: list[list[dict[str, Any]] | None] = [None] * K
    dist.all_gather_object(gathered, rows)
    return sorted((row for part in gathered for row in part or []), key=lambda row: row["stage"])


# The timeline's kinds, as the cost model names them (``costmodel.per_rank``).
KIND = {
    "forward": "forward",
    "recompute": "recompute",
    "backward": "backward",
    "backward-input": "backward",
    "backward-weight": "backward",
    "loss": "backward",
    "update": "update",
}


def traced_kinds(stage: GPipeStage, runner: Runner, timing: Timing) -> list[dict[str, float]]:
    """A collective: one more step of ``runner`` with ``stage``'s timeline on (the first clean one of up to 3); per
    rank, seconds of forward, recompute, backward (its halves and the loss), update, and the rest of the step
    ("other"), on every rank."""
    for _attempt in range(3):
        pause_until_quiet(timing.wait_quiet / 4, timing.clean_threshold)
        runner.reset()
        stage.timeline.clear()
        stage.timeline.enabled = True
        rec, _ = timed(runner.step)
        stage.timeline.enabled = False
        if rec["foreign_cores"] < timing.clean_threshold:
            break
    kinds = {"forward": 0.0, "recompute": 0.0, "backward": 0.0, "update": 0.0}
    for e in stage.timeline.events:
        if e.kind in KIND:
            kinds[KIND[e.kind]] += (e.end_ns - e.start_ns) / 1e9
    stage.timeline.clear()
    mine = {**kinds, "other": rec["s"] - sum(kinds.values()), "step": rec["s"], "foreign_cores": rec["foreign_cores"]}
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [g for g in gathered if g is not None]


def engines_of(lc: LayerCosts, stages: list[dict[str, Any]], M: int) -> dict[tuple[int, int], float]:
    """Per stage (its layers' start, stop), ``rank_stage_times``' co-run time over its layers' costs in ``lc``."""
    return {
        (a, b): engine_factor(lc.layers(a, b), row["corun_s"], M, row["checkpoint"])
        for row in stages
        for a, b in [row["layers"]]
    }


PARTS = ("forward", "recompute", "backward", "update", "other")


def parts_rows(model: str, K: int, schedule: str, traced: list[dict[str, float]], p: Prediction) -> list[dict]:
    """Per rank: a traced step's seconds per kind of work beside the prediction's, in ms (``traced_kinds``,
    ``costmodel.per_rank``)."""
    rows = []
    for r, (got, want) in enumerate(zip(traced, p.ranks, strict=True)):
        row: dict[str, Any] = {"model": model, "K": K, "schedule": schedule, "rank": r}
        row |= {kind: f"{got[kind] * 1e3:.0f} / {want[kind] * 1e3:.0f}" for kind in PARTS}
        row |= {"step": f"{got['step'] * 1e3:.0f} / {p.step * 1e3:.0f}", "foreign_cores": got["foreign_cores"]}
        row["measured_ms"] = {kind: got[kind] * 1e3 for kind in (*PARTS, "step")}
        row["predicted_ms"] = {**{kind: want[kind] * 1e3 for kind in PARTS}, "step": p.step * 1e3}
        rows.append(row)
    return rows
