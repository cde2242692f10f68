"""The simulator as a cost model: per-layer costs measured in one process, summed per stage, timed by simulate."""

# What a stage's action costs (pipe.schedule.simulator.Costs, in seconds), from the layers it holds (``balance``), each
# measured on one micro-batch as the engine runs it:
#   F: a dropped micro-batch's forward, without autograd on the CPU (pipe.state.rematerialize.first_forward);
#      F_kept: a kept one's, under grad; which is which per micro-batch and chunk as ``schedules.keeps_graph`` decides.
#   R: the recompute before the backward of a dropped micro-batch, under ``rematerialize.recomputing`` as the engine
#      runs it: deferred BatchNorm normalizes without accumulating its statistics again (on AmoebaNet-D about 0.7 of
#      a kept forward, which the recompute used to be charged).
#   B: the backward from the output gradient. On a rank whose actions hold W's ("zb-h1" past rank 0: ``fuse_halves``
#      fuses the others), its forward and recompute run under ``weight_grad.WeightGrads``' deferring mode and its
#      backward splits into I (the input gradient, the weight gradients deferred) and W (their closures), all four
#      timed so, with the ops that split at the validated K and M (``weight_grad.split_pays``). On the last stage B
#      and I begin with the loss of the micro-batch (its forward and backward).
#   transfer: a gloo send → receive of the stage's output (its header, then each tensor), from a latency + bytes /
#      bandwidth fit of ping-pongs between two processes (``fit_link``); grad_transfer: its input gradient's.
#   send_host, grad_send_host, recv_host: what a message costs its two ranks' own time, beside the link's: posting
#      a send (the header pickled, an isend per tensor: 0.55–0.65 ms for two tensors here, a third of a transfer), and
#      posting the receive of an output gradient before the recompute and reading it after (0.5–0.65 ms). The
#      engine factor's one-stage pipelines send nothing, so this is apart from it; interleaving sends three times as
#      many messages per rank.
#      Measured in the K = 2 launch through the transport as the runtime uses it (``gloo_link.message_host``:
#      one rank posts, the other has its receive posted; medians), fitted as fixed + per tensor (``fit_host``).
#   What the engine adds beyond the layers (per-layer reseeding, buffer snapshots, boundary checks, splitting,
#   joining, its Python between the actions), and what timing a layer alone misses, is a factor that scales every
#   compute cost of a stage: a one-stage pipeline of exactly that stage's layers, its measured forward_backward over
#   its layers' costs (``engine_factor``; checkpoint "always" on a stage that is not the last, so that it runs a
#   middle stage's dropped forwards, recomputes and backwards, else "except_last", the last stage's kept forwards).
#   Two ways to get it:
#   - per stage, in the K-process launch (``benchmarks._lib.costmodel_ranks.StageTimes``): each rank times its
#     stages' one-stage pipelines in its own process while the other ranks time theirs (the co-run the real step has:
#     ranks computing at once share the memory system, and gloo's copies run on the same cores), and alone, rank by
#     rank, by turns with the validated steps (this VM's speed drifts by 10–20 % over minutes: the factors must be
#     measured under the steps' conditions). The validated prediction uses these (``predict(engines=...)``).
#   - one process (``LayerCosts.engine``, for K where no launch is possible, as GPipe's Table 2 at K = 8): the whole
#     model's one-stage pipeline in this process, times ``corun``, the mean co-run ÷ alone of the launch's stages.
#     Carried over: the engine's share (the same code per action on every stage) and the co-run slowdown (measured
#     with 2 ranks on 2 cores; with K ranks on K cores the memory system is shared K ways: an assumption).
# The step = the last rank's finish in ``simulate`` (gloo's buffered sends: nccl=False), + the status all-reduce that
# ends forward_backward on every rank at once (2⌈log2 K⌉ latencies), + the longest optimizer update of a rank (RMSprop
# over its layers' parameters, measured per layer, times ``corun``).

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks._lib.gloo_link import Link
from lightning_gpipe.pipe import solve
from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_map
from lightning_gpipe.pipe.run.weight_grad import WeightGrads
from lightning_gpipe.pipe.schedule.registry import chunk_of, executed, keeps_graph, lookup, rank_of
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages
from lightning_gpipe.pipe.state.batchnorm import convert_deferred_batch_norm, deferred_statistics
from lightning_gpipe.pipe.state.rematerialize import Checkpoint, recomputing


@dataclass
class LayerCosts:
    """Per layer of a model, medians in seconds for one micro-batch of ``n`` samples; bytes of what crosses a cut."""

    n: int
    forward: list[float]  # without autograd: a dropped micro-batch's first forward
    kept: list[float]  # under grad, BatchNorm statistics accumulated: a kept forward
    recompute: list[float]  # under grad as the engine recomputes (statistics not accumulated again)
    backward: list[float]
    update: list[float]  # RMSprop over the layer's parameters
    out_bytes: list[list[int]]  # each tensor of the layer's output
    grad_bytes: list[list[int]]  # each tensor of its output that gets a gradient (sent back across a cut)
    # On a rank that runs W's: the kept forward, the recompute, I and W under WeightGrads' deferring mode.
    split_kept: list[float] = field(default_factory=list)
    split_recompute: list[float] = field(default_factory=list)
    split_input: list[float] = field(default_factory=list)
    split_weight: list[float] = field(default_factory=list)
    loss: float = 0.0  # the last stage's loss: forward and backward, from the model's output
    engine: float = 1.0  # the engine's time per unit of the layers' (see the module's comment)
    corun: float = 1.0  # with K ≥ 2: a rank's compute time while the others compute too, per unit of its time alone

    def cut_costs(self) -> list[float]:
        """What the balance solver splits: each layer's forward under grad + backward, as ``balance="time"``."""
        return [f + b for f, b in zip(self.kept, self.backward, strict=True)]

    def layers(self, start: int, stop: int) -> LayerCosts:
        """The costs of layers ``start`` … ``stop`` − 1 alone, as a model of their own (the loss only with the last)."""
        cut = {k: v[start:stop] for k, v in self.as_dict().items() if isinstance(v, list)}
        loss = self.loss if stop == len(self.forward) else 0.0
        return LayerCosts(**{**self.as_dict(), **cut, "loss": loss})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


KINDS: tuple[str, ...] = ("forward", "kept", "recompute", "backward", "update")
KINDS += ("split_kept", "split_recompute", "split_input", "split_weight")


def _layer_times(
    layer: nn.Module, x: Any, optimizer: torch.optim.Optimizer | None, split_shape: tuple[int, int] | None
) -> tuple[list[float], Any]:
    """One run of every kind in ``KINDS`` on ``layer`` (its gradients cleared after); and its output. The split
    kinds with the ops that split at ``split_shape`` = (K, M) (``weight_grad.split_pays``; None: every op)."""

    def graph(*modes: Any) -> tuple[float, list[torch.Tensor]]:
        inputs = tree_map(_leaf, x)
        with contextlib.ExitStack() as stack:
            for mode in (deferred_statistics(), *modes):
                stack.enter_context(mode)
            t, out = _clock(lambda: layer(inputs))
        return t, out

    with torch.no_grad(), deferred_statistics():
        t_f, _ = _clock(lambda: layer(tree_map(_leaf, x)))
    t_r, _ = graph(recomputing())
    t_k, out = graph()
    outs = _grad_outputs(out)
    grads = [torch.ones_like(t) for t in outs]
    t_b, _ = _clock(lambda: torch.autograd.backward(outs, grads) if outs else None)
    split = WeightGrads(layer, split_shape)
    try:
        with split.deferring(2):  # the step's first split forward decides which ops split: a step pays it once
            graph()
        with split.deferring(1):
            t_sr, _ = graph(recomputing())
        with split.deferring(0):
            t_sk, split_out = graph()
        split_outs = _grad_outputs(split_out)
        t_si, _ = _clock(lambda: torch.autograd.backward(split_outs, grads) if split_outs else None)
        t_sw, _ = _clock(lambda: split.run(0))
    finally:
        split.close()
    t_u = 0.0
    params = [p for p in layer.parameters() if p.requires_grad]
    if optimizer is not None:
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        t_u, _ = _clock(optimizer.step)
    for p in params:
        p.grad = None
    return [t_f, t_k, t_r, t_b, t_u, t_sk, t_sr, t_si, t_sw], out


def profile_layers(
    model: nn.Sequential,
    sample: Any,
    loss: Any,
    *,
    repeat: int = 5,
    warmup: int = 1,
    split_shape: tuple[int, int] | None = None,
) -> LayerCosts:
    """Time each layer of ``model`` on ``sample`` (one micro-batch), fed through the preceding layers; zb-h1's split
    halves with the ops that split at ``split_shape`` = (K, M) (None: every op).

    ``loss(output)``: the last stage's loss of the micro-batch. Its BatchNorm layers become deferred, as in a stage
    (``convert_deferred_batch_norm``, in place: profile a copy), timed inside ``deferred_statistics``.
    """
    n = tree_flatten(sample)[0][0].shape[0]
    convert_deferred_batch_norm(model)  # as a stage runs them: normalized per micro-batch, statistics accumulated
    medians: dict[str, list[float]] = {k: [] for k in KINDS}
    out_bytes: list[list[int]] = []
    grad_bytes: list[list[int]] = []
    x = sample
    for layer in model:
        params = [p for p in layer.parameters() if p.requires_grad]
        optimizer = torch.optim.RMSprop(params, lr=1e-9) if params else None
        runs = [_layer_times(layer, x, optimizer, split_shape) for _ in range(warmup + repeat)][warmup:]
        for i, key in enumerate(KINDS):
            medians[key].append(statistics.median(times[i] for times, _ in runs))
        out = runs[-1][1]
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
        medians["kept"],
        medians["recompute"],
        medians["backward"],
        medians["update"],
        out_bytes,
        grad_bytes,
        split_kept=medians["split_kept"],
        split_recompute=medians["split_recompute"],
        split_input=medians["split_input"],
        split_weight=medians["split_weight"],
        loss=statistics.median(loss_times[warmup:]),
    )


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
    ranks: list[dict[str, float]] = field(default_factory=list)  # per rank: seconds per kind of work (``per_rank``)

    def on_cores(self, cores: int) -> float:
        """The step when the K ranks share ``cores`` cores: at least their work spread over the cores."""
        return max(self.step, self.work / min(cores, self.K))


def stage_costs(lc: LayerCosts, link: Link, layers: range, *, last: bool, first: bool, split: bool, e: float) -> Costs:
    """One stage's Costs from its layers, each compute cost times ``e`` (the stage's engine factor); ``split``: its
    rank runs W's, so its forwards under grad, recomputes and backwards run split (see the module's comment)."""

    def total(key: str) -> float:
        return sum(getattr(lc, key)[i] for i in layers)

    loss = lc.loss if last else 0.0
    prefix = "split_" if split else ""
    I = e * (total("split_input") + loss)  # noqa: E741 (the zero-bubble paper's name)
    W = e * total("split_weight")
    B = I + W if split else e * (total("backward") + loss)  # a fused B on a split rank runs both halves
    out = link.time(lc.out_bytes[layers[-1]]) if not last else 0.0
    back = link.time(lc.grad_bytes[layers[0] - 1]) if not first else 0.0
    host = {
        "send_host": link.sender(lc.out_bytes[layers[-1]]) if not last else 0.0,
        "grad_send_host": link.sender(lc.grad_bytes[layers[0] - 1]) if not first else 0.0,
        "recv_host": link.receiver(lc.grad_bytes[layers[-1]]) if not last else 0.0,
    }
    return Costs(
        F=e * total("forward"),
        F_kept=e * total(prefix + "kept"),
        B=B,
        I=I,
        W=W,
        R=e * total(prefix + "recompute"),
        transfer=out,
        grad_transfer=back,
        **host,
    )


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
    engines: dict[tuple[int, int], float] | None = None,
) -> Prediction:
    """The simulated step of ``schedule`` on K ranks (v virtual stages each), M micro-batches of ``lc.n`` samples.

    ``engines``: per stage, by its layers (start, stop), the engine factor measured in the K-process launch (co-run
    included); the stages it lacks get the one-process ``lc.engine`` × ``lc.corun``."""
    S = v * K
    # Cut as GPipeStage cuts measured costs: one chunk per rank by the costliest stage, interleaved chunks for the
    # shortest simulated step of each rank's virtual stages together (chunks.solve_virtual_stages).
    cut = solve(lc.cut_costs(), S) if v == 1 else solve_virtual_stages(lc.cut_costs(), K, v, M, checkpoint)
    counts = list(balance) if balance is not None else cut
    if len(counts) != S or sum(counts) != len(lc.forward):
        raise ValueError(f"balance {counts} must split {len(lc.forward)} layers into {S} stages")
    actions = executed(schedule, K, M, v)  # as the executor runs them
    bounds = [sum(counts[:s]) for s in range(S + 1)]
    corun = lc.corun if K > 1 else 1.0
    table: dict[tuple[int, int], Costs] = {}
    placement = lookup(schedule).placement
    for s in range(S):
        r, c = rank_of(s, K, placement), chunk_of(s, K, placement)
        split = any(a.kind == "W" for a in actions[r])
        e = (engines or {}).get((bounds[s], bounds[s + 1]), lc.engine * corun)
        layers = range(bounds[s], bounds[s + 1])
        table[r, c] = stage_costs(lc, link, layers, last=s == S - 1, first=s == 0, split=split, e=e)
    result = simulate(actions, K, v, table, nccl=nccl, checkpoint=checkpoint, placement=placement)
    held = [[s for s in range(S) if rank_of(s, K, placement) == r] for r in range(K)]
    update = [corun * sum(lc.update[i] for s in held[r] for i in range(bounds[s], bounds[s + 1])) for r in range(K)]
    # Every rank leaves forward_backward at once: its status check is an all-reduce over the stages.
    status = 2 * math.ceil(math.log2(K)) * link.latency
    step = result.makespan + status + max(update)
    ranks = per_rank(result.timeline, table, actions, checkpoint, step, update)
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
        sum(r["forward"] + r["recompute"] + r["backward"] + r["update"] for r in ranks),
        [{"stage": s, **asdict(table[rank_of(s, K, placement), chunk_of(s, K, placement)])} for s in range(S)],
        ranks,
    )


def per_rank(
    timeline: list[list[tuple[Any, float, float]]],
    table: dict[tuple[int, int], Costs],
    actions: list[list[Any]],
    checkpoint: Checkpoint,
    step: float,
    update: list[float],
) -> list[dict[str, float]]:
    """Per rank, seconds of forward, recompute (before a B or I, as simulate charges it), backward (B, I and W, the
    last stage's loss included), update, and the rest of the step ("other": waits, transfers, the status check)."""
    out = []
    for r, row in enumerate(timeline):
        kinds = {"forward": 0.0, "recompute": 0.0, "backward": 0.0, "update": update[r]}
        for a, start, end in row:
            kinds["forward" if a.kind == "F" else "backward"] += end - start
            if a.kind in ("B", "I") and not keeps_graph(checkpoint, actions[r], a.m, a.c):
                kinds["recompute"] += table[r, a.c].R
        out.append({**kinds, "other": step - sum(kinds.values())})
    return out


def engine_factor(lc: LayerCosts, measured: float, M: int, checkpoint: Checkpoint = "except_last") -> float:
    """A one-stage pipeline of ``lc``'s layers: its measured forward_backward over M micro-batches, per unit of its
    layers' costs (the engine's share; see the module's comment)."""
    bare = LayerCosts(**{**lc.as_dict(), "engine": 1.0})
    return measured / predict(bare, Link(0.0, float("inf")), "gpipe", 1, M, checkpoint=checkpoint).makespan
