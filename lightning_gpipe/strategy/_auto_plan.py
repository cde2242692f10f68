"""GPipeStrategy's ``"auto"``: the schedule, M, v and re-materialization chosen at setup, and checked after a few steps.

Rank 0 measures the backbone on ``example_input_array`` (each layer's forward + backward time, what autograd saves,
its output and weights: :class:`~lightning_gpipe.pipe.split.plan.Profile`) and the engine's time per action that
computes nothing, simulates every candidate the fixed arguments leave open (``pipe.split.plan.plan``) within
``max_memory_per_stage``, logs the best few, and every rank takes the first: its schedule, M, v, re-materialization
and layer counts. After ``CHECK_STEPS`` training steps rank 0 sets their median beside the prediction and warns,
naming a better candidate, where they part by more than 10 % (``plan.check``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_gpipe.pipe.microbatch import batch_size, split, tensors
from lightning_gpipe.pipe.run.compiled import is_compiled, splits
from lightning_gpipe.pipe.run.executor import Executor
from lightning_gpipe.pipe.run.failures import FailureHandler
from lightning_gpipe.pipe.run.loss_inside import forward_backward
from lightning_gpipe.pipe.run.weight_grad import weight_ops
from lightning_gpipe.pipe.split.balance import costs_by_time
from lightning_gpipe.pipe.split.plan import (
    Prediction,
    Profile,
    check,
    default_Ms,
    default_schedules,
    describe,
    fit_layer_costs,
    layer_bytes,
    plan,
)
from lightning_gpipe.pipe.state.buffers import StatefulBuffers
from lightning_gpipe.pipe.state.rematerialize import CHECKPOINT_MODES
from lightning_gpipe.pipe.trace.events import Timeline
from lightning_gpipe.strategy._balance import _picklable, backbone_input

AUTO_ARGUMENTS = ("schedule", "chunks", "virtual_stages", "activation_checkpointing")
# The training steps timed for the check: the first ones warm caches and allocators up.
CHECK_STEPS = range(2, 7)
# Weight, gradient and AdamW's two moments per weight byte (the optimizer is not known at setup).
STATE_PER_WEIGHT = 4.0


def wants_plan(strategy: Any) -> bool:
    return any(getattr(strategy, name) == "auto" for name in AUTO_ARGUMENTS)


def choose(strategy: Any, module: nn.Module, backbone: nn.Sequential) -> PlanCheck:
    """Collective: the plan on global rank 0, broadcast; the strategy's ``"auto"`` arguments and ``balance`` set to
    its first candidate's."""
    mesh, device, autos = strategy._mesh, strategy.root_device, _autos(strategy)
    link = _measure_link(mesh.pp_group, strategy.global_rank, device)
    result: list[Any] = [None, None]
    if strategy.global_rank == 0:
        try:
            result[0] = _plan(strategy, module, backbone, mesh.K, device, link)
        except Exception as e:  # the others wait in the broadcast: they raise it too
            result[1] = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
    planned, error = strategy.broadcast(result)
    if error is not None:
        raise error
    ranked, strategy._planned_costs = planned
    chosen: Prediction = ranked[0]
    c = chosen.candidate
    strategy.schedule, strategy.chunks, strategy.virtual_stages = c.schedule, c.M, c.v
    strategy.activation_checkpointing, strategy.balance = c.checkpoint, list(chosen.balance)
    rank_zero_info(
        f"GPipeStrategy: the plan for {', '.join(f'{n}=auto' for n in autos)} on K = {mesh.K} "
        f"(predicted from costs measured on rank 0; peak memory counts weights × {STATE_PER_WEIGHT:g} for weight, "
        f"gradient and optimizer state):\n{describe(ranked)}\nchose {c}, layers per stage {chosen.balance}"
    )
    return PlanCheck(chosen, ranked)


def _autos(strategy: Any) -> list[str]:
    return [name for name in AUTO_ARGUMENTS if getattr(strategy, name) == "auto"]


def _plan(
    strategy: Any, module: nn.Module, backbone: nn.Sequential, K: int, device: torch.device, link: tuple[float, float]
) -> tuple[list[Prediction], list[float]]:
    """Rank 0's ranked predictions over what the fixed arguments leave open, and the layers' measured costs."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ValueError(
            f"GPipeStrategy({', '.join(f'{n}=auto' for n in _autos(strategy))}) measures the backbone on one "
            "mini-batch, which it takes from the LightningModule's example_input_array: set self.example_input_array "
            "to an input of forward() with a mini-batch's worth of samples, or give those arguments values"
        )
    if any(t.is_meta for t in (*backbone.parameters(), *backbone.buffers())):
        raise ValueError(
            "GPipeStrategy(…='auto') times each backbone layer, but the model is on the meta device (configure_model): "
            "give schedule, chunks, virtual_stages and activation_checkpointing values"
        )
    x = backbone_input(module, backbone, example, "time")
    N = batch_size(x, strategy.batch_dim)
    dp = dist.get_world_size(strategy._mesh.dp_group) if strategy.data_parallel == "fsdp" else 1
    profile = measure_profile(backbone, x, N, device, dp, strategy.batch_dim, link)
    inside = strategy.pipeline_loss is not False and callable(getattr(module, "pipeline_loss", None))
    fixed = {name: getattr(strategy, name) for name in AUTO_ARGUMENTS if getattr(strategy, name) != "auto"}
    # With the loss outside, training runs GPipe's phases, each rank's chunks one after the other: no schedule to pick.
    schedules = [fixed["schedule"]] if "schedule" in fixed else None if inside else ["gpipe"]
    if schedules is None and (strategy.compile or any(is_compiled(layer) for layer in backbone)):
        schedules = [s for s in default_schedules() if not splits(s)]  # compiled layers: no split backward
    vs = [fixed["virtual_stages"]] if "virtual_stages" in fixed else (1, 2) if inside else (1,)
    ranked = plan(
        profile,
        K,
        _budget(strategy.max_memory_per_stage, device),
        schedules=schedules,
        Ms=[fixed["chunks"]] if "chunks" in fixed else default_Ms(K, N),
        vs=vs,
        checkpoints=[fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else CHECKPOINT_MODES,
    )
    return ranked, list(profile.costs)


def measure_profile(
    backbone: nn.Sequential,
    x: Any,
    N: int,
    device: torch.device,
    dp: int = 1,
    batch_dim: int = 0,
    link: tuple[float, float] = (0.0, math.inf),
) -> Profile:
    """The plan's view of ``backbone`` on its input ``x`` (a mini-batch of N samples): each layer's time on all N and
    on an eighth of them (the part that grows with the samples and the part that does not: ``fit_layer_costs``),
    its saved, output and weight bytes, the ops a split could defer, the engine's time per action; ``dp``: the
    replicas that share the state (FSDP); ``link``: a message's latency (seconds, half of it each end's host time)
    and the bandwidth (bytes/s) between two stages (:func:`_measure_link`)."""
    latency, bandwidth = link
    activation, output, weights = layer_bytes(backbone, x)
    host = _host_per_action(device)
    whole = costs_by_time(backbone, x, device=device)
    part = split(x, 8, batch_dim=batch_dim)[0] if N >= 2 else None
    n = batch_size(part, batch_dim) if part is not None else N
    costs, fixed = (
        (whole, [0.0] * len(whole))
        if n >= N
        else fit_layer_costs(costs_by_time(backbone, part, device=device), whole, n, N, N)
    )
    return Profile(
        N,
        costs,
        activation,
        output,
        weights,
        fixed_costs=fixed,
        weight_ops=weight_ops(backbone, x),
        input_bytes=float(sum(t.nbytes for t in tensors(x))),
        state_bytes_per_param_byte=STATE_PER_WEIGHT / dp,  # FSDP: each replica holds 1/dp of its stage's state
        host_per_action=host,
        message_host=max(host, latency / 2),
        bandwidth=bandwidth,
    )


def _measure_link(group: dist.ProcessGroup, rank: int, device: torch.device, repeat: int = 5) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a message between global rank 0 and the next stage of its pipeline: median
    round trips of 4 KiB and 4 MiB on the pipeline's group, halved. Those two ranks take part; the others get
    (0, inf), and so do they on a pipeline of one stage."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) < 2 or ranks[0] != 0 or rank not in ranks[:2]:
        return 0.0, math.inf
    peer = ranks[1] if rank == 0 else ranks[0]
    one_way = []
    for size in (4 << 10, 4 << 20):
        buf = torch.zeros(size // 4, device=device)
        times = []
        for _ in range(repeat + 1):  # the first warms the connection up
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            times.append(time.perf_counter() - start)
        one_way.append(statistics.median(times[1:]) / 2)
    slope = (one_way[1] - one_way[0]) / ((4 << 20) - (4 << 10))
    return max(0.0, one_way[0] - slope * (4 << 10)), 1 / slope if slope > 0 else math.inf


def _budget(budget: int | float | None, device: torch.device) -> int | None:
    """Bytes a rank may hold: as given, or that fraction of its device's memory (on the CPU, of the machine's memory
    shared by the processes on it)."""
    if budget is None or isinstance(budget, int):
        return budget
    if device.type == "cuda":
        return int(budget * torch.cuda.get_device_properties(device).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(budget * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local)


def _host_per_action(device: torch.device, M: int = 8, repeat: int = 5) -> float:
    """The engine's time per action that computes nothing: the median step of a one-stage pipeline of a one-element
    layer over M one-sample micro-batches (the loss inside), per action (2M). What a smaller micro-batch does not
    shrink; messages are taken to cost as much on each end's host. The check after the first steps corrects for
    what this misses."""
    layer = nn.Sequential(nn.Linear(1, 1)).to(device)
    timeline = Timeline(0, enabled=False, device=device)
    stage = Executor(
        layer, lambda x, seed, copy=True: layer(x), index=0, num_stages=1, checkpoint="except_last", batch_dim=0,
        device=device, producer="a one-element layer", stateful_buffers=StatefulBuffers(layer),
        failures=FailureHandler(0, 1, None, timeline), links=None, timeline=timeline,
    )  # fmt: skip
    x = torch.ones(M, 1, device=device)
    times = []
    for _ in range(repeat + 1):  # the first warms up
        start = time.perf_counter()
        forward_backward([stage], x, M, lambda y, m: y.sum(), "gpipe")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / (2 * M)


class PlanCheck:
    """Times the training steps ``CHECK_STEPS`` (from the step's start to the end of its backward, the reduction
    included) and, after the last, tells on rank 0 where their median misses the prediction by more than 10 %: a
    warning where the corrected model names a better candidate (``plan.check``), else an info line."""

    def __init__(self, chosen: Prediction | None = None, ranked: list[Prediction] | None = None) -> None:
        self.chosen, self.ranked = chosen, ranked or []  # None: nothing planned, nothing to check
        self.steps = 0
        self.times: list[float] = []
        self.started: float | None = None
        self.message: str | None = None

    def begin(self) -> None:
        self.started = time.perf_counter() if self.chosen is not None and self.steps in CHECK_STEPS else None
        self.steps += 1

    def end(self) -> None:
        if self.started is None or self.chosen is None:
            return
        self.times.append(time.perf_counter() - self.started)
        self.started = None
        if len(self.times) == len(CHECK_STEPS):
            verdict = check(self.chosen, statistics.median(self.times), self.ranked)
            self.message = None if verdict is None else verdict.message
            if verdict is not None:  # a warning only where another candidate is predicted faster
                (rank_zero_info if verdict.better is None else rank_zero_warn)(f"GPipeStrategy: {verdict.message}")
