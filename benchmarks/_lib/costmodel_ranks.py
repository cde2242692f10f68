"""The cost model's measurements inside the K-process launch: each rank's one-stage pipelines; a traced step by kind."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib.costmodel import LayerCosts, Prediction, engine_factor
from benchmarks._lib.gloo_link import Link
from benchmarks._lib.machine import MIN_CLEAN, Runner, Timing, pause_until_quiet, timed
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe._torch_internals import tree_flatten
from lightning_gpipe.pipe.schedule.registry import executed, keeps_graph
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from lightning_gpipe.pipe.state.rematerialize import Checkpoint

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


class StageTimes:
    """Every stage of a vK ``balance`` as a one-stage pipeline of its layers, in the process of the rank that holds
    it: runners for ``measure``, taken by turns with the schedules' steps (so under the same conditions, drifts
    included), then each stage's median time, co-run (every rank runs its stages at once) and alone (one rank runs
    its stages, the others wait in a barrier, which uses no CPU). Checkpoint "always" but on the last stage
    ("except_last"), so that each runs the kinds of actions it runs in a step. ``x``: the model's input (the global
    batch); ``loss``: the last stage's, per micro-batch; ``single``: a group of this rank alone."""

    def __init__(
        self, build: Callable[[], nn.Sequential], x: Any, loss: LossFn, balance: list[int], v: int, M: int, single: Any
    ) -> None:
        self.rank, self.K, self.v = dist.get_rank(), dist.get_world_size(), v
        self.bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
        self.mine: list[tuple[int, Checkpoint, GPipeStage, Any, LossFn]] = []
        for c in range(v):
            s = c * self.K + self.rank
            model = build()
            last = s == len(balance) - 1
            checkpoint: Checkpoint = "except_last" if last else "always"
            layers = nn.Sequential(*list(model)[self.bounds[s] : self.bounds[s + 1]])
            stage = GPipeStage(layers, chunks=M, balance=[len(layers)], checkpoint=checkpoint, group=single)
            self.mine.append((s, checkpoint, stage, stage_input(model, x, self.bounds[s]), loss if last else sum_loss))
        self.times: dict[str, list[list[float]]] = {}

    def _run(self, name: str, here: bool) -> None:
        times = []
        for _, _, stage, x, loss in self.mine if here else ():
            start = time.perf_counter()
            stage.forward_backward(x, loss)
            times.append(time.perf_counter() - start)
        self.times.setdefault(name, []).append(times)

    def _reset(self) -> None:
        for _, _, stage, _, _ in self.mine:
            stage.zero_grad(set_to_none=True)

    def runners(self) -> dict[str, Runner]:
        names = {f"stages v={self.v}": True}
        names |= {f"stages v={self.v} alone on rank {r}": r == self.rank for r in range(self.K)}
        return {name: Runner(self._reset, partial(self._run, name, here)) for name, here in names.items()}

    def rows(self, records: dict[str, list[dict]]) -> list[dict[str, Any]]:
        """A collective: per stage, its layers, checkpoint, and median seconds co-run and alone, over the clean steps
        of ``measure``'s ``records`` (all of them when fewer than ``MIN_CLEAN``); every rank gets every stage's."""

        def median(name: str, i: int) -> float:
            recs = records[name]
            calls = self.times[name][-len(recs) :]  # the warm-up calls have no record
            clean = [t for t, r in zip(calls, recs, strict=True) if r["clean"]]
            return statistics.median(t[i] for t in (clean if len(clean) >= MIN_CLEAN else calls))

        alone = f"stages v={self.v} alone on rank {self.rank}"
        rows = [
            {
                "stage": s,
                "layers": [self.bounds[s], self.bounds[s + 1]],
                "checkpoint": checkpoint,
                "corun_s": median(f"stages v={self.v}", i),
                "alone_s": median(alone, i),
            }
            for i, (s, checkpoint, *_) in enumerate(self.mine)
        ]
        gathered: list[list[dict[str, Any]] | None] = [None] * self.K
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


def traced_kinds(stage: GPipeStage, runner: Runner, timing: Timing, steps: int = 5) -> list[dict[str, Any]]:
    """A collective: ``steps`` more steps of ``runner`` with ``stage``'s timeline on (each the first clean one of up
    to 3); per rank, the median over them of the seconds of forward, recompute, backward (its halves and the loss),
    update, and the rest of the step ("other"), on every rank. One traced step alone moved a rank's eight forwards
    1.6 × between schedules of the same work on the 2-core VM. For ``replayed``, per traced step: "units",
    ``action_times``; "steps", the step (the slowest rank's); "updates", the rank's update."""
    per_step: list[dict[str, float]] = []
    units: list[list[list[Any]]] = []  # per traced step: [kind, micro-batch, chunk, seconds] per action
    for _ in range(steps):
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
        units.append([[*key, seconds] for key, seconds in action_times(stage.timeline.events).items()])
        stage.timeline.clear()
        per_step.append(
            {**kinds, "other": rec["s"] - sum(kinds.values()), "step": rec["s"], "foreign_cores": rec["foreign_cores"]}
        )
    mine: dict[str, Any] = {key: statistics.median(step[key] for step in per_step) for key in per_step[0]}
    mine |= {"traced_steps": steps, "units": units, "steps": [step["step"] for step in per_step]}
    mine["updates"] = [step["update"] for step in per_step]
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [g for g in gathered if g is not None]


ENDS = ("forward", "backward", "backward-input", "backward-weight")  # the event that ends each kind of action


def action_times(events: list[Any]) -> dict[tuple[str, int, int], float]:
    """A rank's own seconds per action of one traced step, by (ending event's kind, micro-batch, chunk): from the end
    of its previous action (the first: from its phase's start) to the end of its own, less the waits for a peer
    between; a backward's recompute apart, as ("recompute", m, c). So each action carries the engine's work around
    it (receiving, sending, checks, the loss of the last stage's backward), which the compute events leave out."""
    events = sorted(events, key=lambda e: e.end_ns)
    phase = [e.start_ns for e in events if e.kind == "step"]
    prev = min(phase) if phase else min((e.start_ns for e in events), default=0)
    waits = [e for e in events if e.kind == "recv-wait"]
    recomputes = {(e.micro_batch, e.chunk): e.end_ns - e.start_ns for e in events if e.kind == "recompute"}
    out = {}
    for e in events:
        if e.kind not in ENDS or e.micro_batch < 0:
            continue
        own = e.end_ns - prev - sum(w.end_ns - w.start_ns for w in waits if w.start_ns >= prev and w.end_ns <= e.end_ns)
        c = max(e.chunk, 0)
        if e.kind in ("backward", "backward-input") and (e.micro_batch, e.chunk) in recomputes:
            out["recompute", e.micro_batch, c] = recomputes[e.micro_batch, e.chunk] / 1e9
            own -= recomputes[e.micro_batch, e.chunk]
        out[e.kind, e.micro_batch, c] = own / 1e9
        prev = e.end_ns
    return out


def _mean(times: dict[int, float], ms: set[int]) -> float | None:
    """The mean over micro-batches ``ms`` of ``times`` (their sum is the rank's); None if none ran."""
    got = [t for m, t in times.items() if m in ms]
    return statistics.fmean(got) if got else None


HOST_IN_ACTIONS = {"send_host": 0.0, "grad_send_host": 0.0, "recv_host": 0.0}


def replayed(p: Prediction, traced: list[dict[str, Any]], link: Link, checkpoint: Checkpoint, i: int) -> float:
    """The step ``simulate`` gives for traced step ``i`` with its own action times (``action_times``): each (rank,
    chunk)'s F, F_kept, R, B, I, W the means over its micro-batches, its links as ``p``'s (the host times are in the
    action times), the status all-reduce, and the longest update of the step. Beside the traced step it tests the
    simulator (the order, the waits, the links) apart from the costs measured outside the step."""
    K, v = p.K, p.v
    S = K * v
    actions = executed(p.schedule, K, p.M, v)
    table = {}
    for s in range(S):
        r, c = s % K, s // K
        units: dict[str, dict[int, float]] = {}
        for kind, m, chunk, seconds in traced[r]["units"][i]:
            if chunk == c:
                units.setdefault(kind, {})[m] = seconds
        every = set(range(p.M))
        kept = {m for m in every if keeps_graph(checkpoint, actions[r], m, c)}
        fields = {
            "F": _mean(units.get("forward", {}), every - kept),
            "F_kept": _mean(units.get("forward", {}), kept),
            "R": _mean(units.get("recompute", {}), every),
            "B": _mean(units.get("backward", {}), every),
            "I": _mean(units.get("backward-input", {}), every),
            "W": _mean(units.get("backward-weight", {}), every),
        }
        base = {k: val for k, val in p.costs[s].items() if k != "stage"} | HOST_IN_ACTIONS
        table[r, c] = Costs(**(base | {k: val for k, val in fields.items() if val is not None}))
    makespan = simulate(actions, K, v, table, nccl=False, checkpoint=checkpoint).makespan
    return makespan + 2 * math.ceil(math.log2(K)) * link.latency + max(rank["updates"][i] for rank in traced)


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
