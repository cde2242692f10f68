"""The simulator as a cost model: per-layer costs measured in this process, summed per stage, timed by simulate."""

# What a stage's action costs (pipe.simulator.Costs, in seconds), from the layers it holds (``balance``):
#   F: the forward of a micro-batch. A micro-batch whose graph is dropped runs it without autograd (on the CPU,
#      pipe.rematerialize.first_forward), a kept one under grad; per chunk, the mean over the rank's micro-batches
#      as ``schedules.keeps_graph`` decides for the re-materialization mode.
#   R: the recompute (the forward under grad) before the backward of a dropped micro-batch.
#   B: the backward from the output gradient (``torch.autograd.backward``), I: the input gradient alone
#      (``torch.autograd.grad`` w.r.t. the layer's inputs), W = B − I (derived: the weight gradient's share of B).
#      On the last stage B and I begin with the loss of the micro-batch (its forward and backward, measured).
#   transfer: a gloo send → receive of the stage's output (its header, then each tensor), from a latency + bytes /
#      bandwidth fit of ping-pongs between two processes (``fit_link``); grad_transfer: its input gradient's.
#   The layers are timed as a stage runs them: BatchNorm deferred (normalized per micro-batch through an interception,
#   statistics accumulated: AmoebaNet's forward_backward takes about 1.4× as long as with plain BatchNorm). What the
#   engine adds beyond (per-layer reseeding, buffer snapshots, boundary checks, splitting and joining) and what
#   per-layer timing misses or overstates is one factor, ``engine``, that scales every compute cost: a one-stage
#   pipeline's measured forward_backward over its layers' costs, measured once per model and M. A factor, not a time
#   per action: a stage of fewer layers pays proportionally less, as when the model is cut into 16 stages.
#   With K ≥ 2 every compute cost (and the update) is also scaled by ``corun``: ranks computing at once share the
#   memory system, and gloo's copies run on the same cores; measured in the K=2 launch (``corun_factor``), each rank
#   timing one micro-batch of the model alone, then both at once.
# The step = the last rank's finish in ``simulate`` (gloo's buffered sends: nccl=False), + the status all-reduce that
# ends forward_backward on every rank at once (2⌈log2 K⌉ latencies), + the longest optimizer update of a rank (RMSprop
# over its layers' parameters, measured per layer).

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import solve
from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_map
from lightning_gpipe.pipe.batchnorm import convert_deferred_batch_norm, deferred_statistics
from lightning_gpipe.pipe.executor import Checkpoint
from lightning_gpipe.pipe.schedules import keeps_graph, lookup
from lightning_gpipe.pipe.simulator import Costs, simulate

HEADER_BYTES = 256  # a pickled header dict (the transport's HEADER_TAG message): the latency alone, in effect


@dataclass
class LayerCosts:
    """Per layer of a model, medians in seconds for one micro-batch of ``n`` samples; bytes of what crosses a cut."""

    n: int
    forward: list[float]  # without autograd: a dropped micro-batch's first forward
    recompute: list[float]  # under grad: a kept forward, and the recompute
    backward: list[float]
    input_grad: list[float]  # I: the gradient w.r.t. the layer's inputs only
    update: list[float]  # RMSprop over the layer's parameters
    out_bytes: list[list[int]]  # each tensor of the layer's output
    grad_bytes: list[list[int]]  # each tensor of its output that gets a gradient (sent back across a cut)
    loss: float = 0.0  # the last stage's loss: forward and backward, from the model's output
    engine: float = 1.0  # the engine's time per unit of the layers' (see the module's comment)
    corun: float = 1.0  # with K ≥ 2: a rank's compute time while the others compute too, per unit of its time alone

    def cut_costs(self) -> list[float]:
        """What the balance solver splits: each layer's forward under grad + backward, as ``balance="time"``."""
        return [f + b for f, b in zip(self.recompute, self.backward, strict=True)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Link:
    """One message's time between two processes: ``latency`` + bytes / ``bandwidth`` (bytes per second)."""

    latency: float
    bandwidth: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (bytes, one-way seconds) measured

    def time(self, sizes: Sequence[int]) -> float:
        """A send of these tensors as the transport makes it: a header, then each tensor."""
        return self.latency + sum(self.latency + b / self.bandwidth for b in sizes)


def _leaf(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().clone()  # a copy: in-place layers must not overwrite the next repetition's input
    return x.requires_grad_(True) if x.is_floating_point() else x


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _clock(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def profile_layers(model: nn.Sequential, sample: Any, loss: Any, *, repeat: int = 5, warmup: int = 1) -> LayerCosts:
    """Time each layer of ``model`` on ``sample`` (one micro-batch), fed through the preceding layers.

    ``loss(output)``: the last stage's loss of the micro-batch. Its BatchNorm layers become deferred, as in a stage
    (``convert_deferred_batch_norm``, in place: profile a copy), timed inside ``deferred_statistics``.
    """
    n = tree_flatten(sample)[0][0].shape[0]
    convert_deferred_batch_norm(model)  # as a stage runs them: normalized per micro-batch, statistics accumulated
    medians: dict[str, list[float]] = {k: [] for k in ("forward", "recompute", "backward", "input_grad", "update")}
    out_bytes: list[list[int]] = []
    grad_bytes: list[list[int]] = []
    x = sample
    for layer in model:
        params = [p for p in layer.parameters() if p.requires_grad]
        optimizer = torch.optim.RMSprop(params, lr=1e-9) if params else None
        times: dict[str, list[float]] = {k: [] for k in medians}
        for run in range(warmup + repeat):
            with torch.no_grad(), deferred_statistics():
                t_f, _ = _clock(lambda: layer(tree_map(_leaf, x)))  # noqa: B023
            inputs = tree_map(_leaf, x)
            with deferred_statistics():
                t_r, out = _clock(lambda: layer(inputs))  # noqa: B023
            outs = _grad_outputs(out)
            grads = [torch.ones_like(t) for t in outs]
            t_b, _ = _clock(lambda: torch.autograd.backward(outs, grads) if outs else None)  # noqa: B023
            inputs = tree_map(_leaf, x)
            leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            with deferred_statistics():
                outs = _grad_outputs(layer(inputs))
            t_i = 0.0
            if outs and leaves:
                t_i, _ = _clock(lambda: torch.autograd.grad(outs, leaves, grads, allow_unused=True))  # noqa: B023
            t_u = 0.0
            if optimizer is not None:
                for p in params:
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                t_u, _ = _clock(optimizer.step)
            for p in params:
                p.grad = None
            if run >= warmup:
                for key, t in zip(medians, (t_f, t_r, t_b, t_i, t_u), strict=True):
                    times[key].append(t)
        for key in medians:
            medians[key].append(statistics.median(times[key]))
        flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_bytes.append([t.numel() * t.element_size() for t in flat])
        grad_bytes.append([t.numel() * t.element_size() for t in flat if t.requires_grad])
        x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    loss_times = []
    for _ in range(warmup + repeat):
        y = tree_map(_leaf, x)
        loss_times.append(_clock(lambda: loss(y).backward())[0])  # noqa: B023
    return LayerCosts(
        n,
        medians["forward"],
        medians["recompute"],
        medians["backward"],
        medians["input_grad"],
        medians["update"],
        out_bytes,
        grad_bytes,
        loss=statistics.median(loss_times),
    )


def ping_pong(peer: int, sizes: Sequence[int], repeat: int = 9) -> list[tuple[int, float]]:
    """(bytes, one-way seconds: median round trip / 2) per size, with ``peer`` (which calls ``echo``) over gloo."""
    out = []
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1))
        trips = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            dist.send(buf, peer)
            dist.recv(buf, peer)
            trips.append(time.perf_counter() - start)
        out.append((buf.numel() * 4, statistics.median(trips[1:]) / 2))
    return out


def echo(peer: int, sizes: Sequence[int], repeat: int = 9) -> None:
    """The other end of ``ping_pong``."""
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1))
        for _ in range(repeat + 1):
            dist.recv(buf, peer)
            dist.send(buf, peer)


def fit_link(samples: Sequence[tuple[int, float]]) -> Link:
    """Least squares of time = latency + bytes / bandwidth over the samples (latency ≥ 0)."""
    xs, ys = [float(b) for b, _ in samples], [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return Link(max(my - slope * mx, 0.0), 1.0 / slope, list(samples))


@dataclass
class Prediction:
    schedule: str
    K: int
    M: int
    v: int
    balance: list[int]
    step: float  # seconds: the pipeline, its status check, the longest update
    makespan: float  # the pipeline alone (simulate)
    bubble: float
    peak: list[int]
    work: float  # every rank's busy time, summed, updates included: the step on fewer cores is at least work / cores
    costs: list[dict[str, float]]  # per stage

    def on_cores(self, cores: int) -> float:
        """The step when the K ranks share ``cores`` cores: at least their work spread over the cores."""
        return max(self.step, self.work / min(cores, self.K))


def stage_costs(
    lc: LayerCosts, link: Link, layers: range, *, last: bool, first: bool, keep: float, corun: float = 1.0
) -> Costs:
    """One stage's Costs from its layers; ``keep``: the share of its micro-batches whose graph is kept."""

    def total(values: list[float]) -> float:
        return sum(values[i] for i in layers)

    e = lc.engine * corun
    F = e * (keep * total(lc.recompute) + (1 - keep) * total(lc.forward))
    B = e * (total(lc.backward) + (lc.loss if last else 0.0))
    I = e * (total(lc.input_grad) + (lc.loss if last else 0.0))  # noqa: E741 (the zero-bubble paper's name)
    W = max(B - I, 0.0)
    out = link.time(lc.out_bytes[layers[-1]]) if not last else 0.0
    back = link.time(lc.grad_bytes[layers[0] - 1]) if not first else 0.0
    R = e * total(lc.recompute)
    return Costs(F=F, B=B, I=I, W=W, R=R, transfer=out, grad_transfer=back)


def predict(
    lc: LayerCosts,
    link: Link,
    schedule: str,
    K: int,
    M: int,
    v: int = 1,
    *,
    checkpoint: Checkpoint = "except_last",
    balance: Sequence[int] | None = None,
    nccl: bool = False,
) -> Prediction:
    """The step of ``schedule`` on K ranks (v chunks each), M micro-batches of ``lc.n`` samples, timed by simulate."""
    S = v * K
    counts = list(balance) if balance is not None else solve(lc.cut_costs(), S)
    if len(counts) != S or sum(counts) != len(lc.forward):
        raise ValueError(f"balance {counts} must split {len(lc.forward)} layers into {S} stages")
    actions = lookup(schedule).actions(K, M, v)
    bounds = [sum(counts[:s]) for s in range(S + 1)]
    corun = lc.corun if K > 1 else 1.0
    table: dict[tuple[int, int], Costs] = {}
    for s in range(S):
        r, c = s % K, s // K
        kept = sum(keeps_graph(checkpoint, actions[r], m, c) for m in range(M)) / M
        layers = range(bounds[s], bounds[s + 1])
        table[r, c] = stage_costs(lc, link, layers, last=s == S - 1, first=s == 0, keep=kept, corun=corun)
    result = simulate(actions, K, v, table, nccl=nccl, checkpoint=checkpoint)
    update = [
        corun * sum(lc.update[i] for s in range(r, S, K) for i in range(bounds[s], bounds[s + 1])) for r in range(K)
    ]
    # Every rank leaves forward_backward at once: its status check is an all-reduce over the stages.
    status = 2 * math.ceil(math.log2(K)) * link.latency
    step = result.makespan + status + max(update)
    busy = sum(end - start for row in result.timeline for _, start, end in row)
    recomputes = sum(
        table[r, a.c].R
        for r, row in enumerate(result.timeline)
        for a, _, _ in row
        if a.kind in ("B", "I") and not keeps_graph(checkpoint, actions[r], a.m, a.c)
    )
    return Prediction(
        schedule,
        K,
        M,
        v,
        counts,
        step,
        result.makespan,
        result.bubble,
        result.peak,
        busy + recomputes + sum(update),
        [{"stage": s, **asdict(table[s % K, s // K])} for s in range(S)],
    )


def engine_factor(lc: LayerCosts, measured: float, M: int, checkpoint: Checkpoint = "except_last") -> float:
    """A one-stage pipeline's measured forward_backward over M micro-batches, per unit of its layers' costs."""
    bare = LayerCosts(**{**lc.as_dict(), "engine": 1.0})
    return measured / predict(bare, Link(0.0, float("inf")), "gpipe", 1, M, checkpoint=checkpoint).makespan


def corun_factor(step: Any, repeat: int = 5) -> float:
    """A collective: ``step()``'s median time with every rank running it at once, over its time alone (rank by rank,
    the others waiting in a barrier, which uses no CPU); the mean over ranks, on every rank."""

    def median_of() -> float:
        times = [_clock(step)[0] for _ in range(repeat + 1)]
        return statistics.median(times[1:])

    alone = 0.0
    for r in range(dist.get_world_size()):
        dist.barrier()
        if r == dist.get_rank():
            alone = median_of()
    dist.barrier()
    ratio = torch.tensor([median_of() / alone], dtype=torch.float64)
    dist.all_reduce(ratio)
    return float(ratio) / dist.get_world_size()
