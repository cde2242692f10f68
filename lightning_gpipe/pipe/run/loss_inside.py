"""A training step with the loss inside the pipeline: each rank runs its schedule's actions, the loss on the last stage.

The schedules are data (``pipe.schedule.registry``: each rank's ordered actions, drawn there); this runner runs every
registered one: "gpipe" and "1f1b" (F m and B m on one chunk per rank), "zb-h1" (B m split into I m and W m:
``pipe.run.weight_grad`` defers the weight gradients of the micro-batch's linear, convolution and embedding ops from
I to W; where W m follows I m at once, as on rank 0, the two run as one B m: ``registry.fuse_halves``) and
"interleaved-1f1b" and "interleaved-zb" (F m and B m, or I m and W m, on each of the rank's v virtual stages, one
executor per chunk: chunk c of rank r is stage cK + r, so micro-batch m leaves rank K − 1's chunk c for rank 0's chunk
c + 1, and its gradient comes back) and "zb-v" (two chunks per rank in a V, stages r and 2K − 1 − r: micro-batch m goes
down the ranks and back up, rank K − 1 hands it from its chunk a to its chunk b in the process, and the loss is on rank
0, which holds the last stage; ``GPipeStage(placement="v")``), after ``pipe.schedule.simulator`` checked them (once
per schedule, K, M and v) in the transport's communicator layout under NCCL's ordering rules.

Each stage runs its actions in order. Sends never block the host; a forward waits for its input and a backward for
its output gradient (posted before the recompute, which fills the wait, as in the fill/drain schedule).
Under ``except_last`` (``pipe/state/rematerialize.py``) the last stage keeps every micro-batch's graph and so holds
one micro-batch's output at a time (under "zb-h1" the I is that backward: a recompute serves both halves, as W needs
only what I kept). Deferred BatchNorm statistics are committed after each virtual stage's last forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import Any

import torch

from lightning_gpipe.pipe.microbatch import join_input_grads, plan_sizes, split_leaves
from lightning_gpipe.pipe.run.executor import Executor, Pairs, settle, wait_sends
from lightning_gpipe.pipe.run.records import Step
from lightning_gpipe.pipe.run.weight_grad import WeightGrads
from lightning_gpipe.pipe.schedule.registry import (
    Action,
    Placement,
    ScheduleName,
    executed,
    inputs_ahead,
    keeps_graph,
    lookup,
)
from lightning_gpipe.pipe.schedule.simulator import simulate
from lightning_gpipe.pipe.state.batchnorm import check_replicas_run_the_same_m, commit_deferred_batch_norm
from lightning_gpipe.pipe.state.rng import restored_streams

# The last stage's loss of one micro-batch: (its output, m) -> a scalar tensor to back-propagate.
LossFn = Callable[[Any, int], torch.Tensor]


def check_schedule(schedule: ScheduleName, K: int, M: int, v: int, placement: Placement = "loop") -> None:
    """The registry's clear ValueError when ``schedule`` refuses v virtual stages per rank, or M micro-batches on K;
    and one when it places a rank's chunks otherwise than the stage holds them (``placement``)."""
    check_placement(schedule, placement, v)
    lookup(schedule).actions(K, M, v)


def check_placement(schedule: ScheduleName, placement: Placement, v: int) -> None:
    """A schedule runs on the chunks where the stage placed them at construction (``registry.Placement``)."""
    wants = lookup(schedule).placement
    if v > 1 and wants != placement:
        held = {"loop": "interleaved (rank r: stages r, r + K, …)", "v": "in a V (rank r: stages r and 2K − 1 − r)"}
        raise ValueError(
            f"schedule={schedule!r} runs each rank's chunks {held[wants]}, but this stage holds them "
            f"{held[placement]}; build the stage with GPipeStage(placement={wants!r}) to run it"
        )


@lru_cache(maxsize=64)
def rank_actions(
    schedule: ScheduleName, K: int, M: int, v: int = 1, placement: Placement = "loop"
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions under ``schedule``, once the simulator found them valid and free of deadlocks."""
    actions = executed(schedule, K, M, v)
    simulate(actions, K, v, placement=placement)
    return tuple(tuple(ops) for ops in actions)


@lru_cache(maxsize=64)
def _inputs_ahead(schedule: ScheduleName, K: int, M: int, v: int, r: int) -> dict[int, Action]:
    """Rank r's F whose input it receives ahead, by the position of the F after whose input it is posted."""
    placement = lookup(schedule).placement
    ops = rank_actions(schedule, K, M, v, placement)[r]
    return {pos: ops[later] for pos, later in inputs_ahead(ops, K, r, v, placement).items()}


def forward_backward(
    executors: Sequence[Executor],
    input: Any,
    micro_batches: int,
    loss_fn: LossFn,
    schedule: ScheduleName,
    drained: Callable[[], None] | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch on this rank's stages, in ``schedule``'s order (drawn above).

    ``executors`` are the rank's stages, one executor each (several with interleaving: rank r holds stages r, r + K,
    …). ``input`` is used on stage 0 only. The last stage calls ``loss_fn(output_m, m)`` for each micro-batch and
    back-propagates the scalar it returns at once; it returns those scalars, detached (the others return []).
    ``drained`` runs once this rank's gradients are complete, before the check that every stage finished;
    ``before_last_backward`` right before this rank's last backward op, after which its gradients are final (a W
    under "zb-h1": the gradients that I gives are final before it, the deferred ones come in it).
    """
    first, v = executors[0], len(executors)
    K, r, placement = first.ranks, first.index, lookup(schedule).placement
    seed = first.seeds.draw()
    losses: list[torch.Tensor] = []
    with first.failures.phase("train", "last") as where, restored_streams(first.device):
        sizes = plan_sizes(input, micro_batches, first.batch_dim) if first.is_first else []
        micro_inputs, input_leaves = split_leaves(input, sizes, first.batch_dim) if first.is_first else ([], [])
        could_require = [any(p.requires_grad for p in s.layers.parameters()) for s in executors]
        steps = [Step([], input_leaves=input_leaves if s.is_first else [], seed=seed) for s in executors]
        for s in executors:
            s.stateful_buffers.begin()
        ops = rank_actions(schedule, K, len(sizes), v, placement)[r] if first.is_first else None
        input_grads: list[list[torch.Tensor]] = [[] for _ in sizes]
        weights: list[WeightGrads | None] = [None] * v

        def roots(y: Any, marks: list[bool], m: int) -> Pairs:
            with first.timeline.record("loss", m):
                loss = loss_fn(y, m)
            losses.append(check_scalar_loss(loss, f"the loss of micro-batch {m}").detach())
            return [(loss, None)] if loss.requires_grad else []

        pos, hooks = 0, contextlib.ExitStack()
        with hooks:  # zb-h1's, removed however the loop ends
            while ops is None or pos < len(ops):
                kind, m, c = ops[pos] if ops is not None else Action("F", 0)
                s, step = executors[c], steps[c]
                where[:] = m, s.place
                if kind == "F":
                    if s.is_first:
                        x, n, M = micro_inputs[m], sizes[m], len(sizes)
                    else:
                        x, got = s.receive(m, training=True)
                        M, n, step.seed = got["M"], got["n"], got["seed"]
                    if ops is None:  # the first header told this rank M
                        ops = rank_actions(schedule, K, M, v, placement)[r]
                        input_grads = [[] for _ in range(M)]
                    if (later := _inputs_ahead(schedule, K, M, v, r).get(pos)) is not None:
                        executors[later.c].receive_ahead(later.m)
                    if m == 0:
                        check_replicas_run_the_same_m(s.layers, M, s.device)
                        if any(a.kind == "W" and a.c == c for a in ops):
                            weights[c] = split = WeightGrads(s.layers, (K, M))
                            hooks.callback(split.close)
                    keep = keeps_graph(s.checkpoint, ops, m, c)
                    # Only a micro-batch whose backward is split (I, then W) defers its weight gradients; one run as
                    # one B (fuse_halves) computes them in it.
                    deferred = weights[c] if Action("W", m, c) in ops else None
                    s.forward_micro(step, x, m, M, n, not keep, could_require[c], deferred)
                    if not keep:
                        step.micro[m].output = None  # the last stage too: recomputed right before its backward
                    if m == M - 1:
                        commit_deferred_batch_norm(s.layers)
                else:
                    if before_last_backward is not None and ops is not None and pos == len(ops) - 1:
                        before_last_backward()
                    if kind == "W":
                        chunk_weights = weights[c]
                        assert chunk_weights is not None, "a W follows its F"
                        s.weight_micro(m, chunk_weights)
                    else:
                        s.backward_micro(step, m, input_grads, partial(roots, m=m), weights[c] if kind == "I" else None)
                pos += 1
        if first.is_first and steps[0].input_leaves:
            torch.autograd.backward(steps[0].input_leaves, join_input_grads(input_grads, first.batch_dim))
        settle(first, where, drained)
    wait_sends(first)
    return losses


def check_scalar_loss(loss: Any, what: str) -> torch.Tensor:
    """``loss`` if it is a one-element tensor, else a TypeError saying what ``what`` returned instead."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise TypeError(f"{what} must be a scalar tensor, got {got}")
