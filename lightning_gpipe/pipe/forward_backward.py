"""A training step with the loss inside the pipeline: GPipe or 1F1B, each micro-batch's loss on the last stage.

K = 3 stages, M = 4 micro-batches, unit costs; F m = forward of micro-batch m, B m = its backward (on the last
stage it begins with the loss of micro-batch m, so its backward starts as soon as its forward ends); '.' = idle:

    "gpipe"                                           "1f1b" (warm-up: min(M, K − k) forwards)
       t  0  1  2  3  4  5  6  7  8  9 10 11             t  0  1  2  3  4  5  6  7  8  9 10 11
    s0 | F0 F1 F2 F3  .  . B0 B1  . B2  . B3         s0 | F0 F1 F2  .  . B0 F3 B1  . B2  . B3
    s1 |  . F0 F1 F2 F3 B0 B1  . B2  . B3  .         s1 |  . F0 F1  . B0 F2 B1 F3 B2  . B3  .
    s2 |  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  .         s2 |  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  .
    micro-batches in flight per stage: 4, 4, 1       micro-batches in flight per stage: 3, 2, 1

Both take 2(M + K − 1) units, GPipe's bubble and nothing else: no stage waits for a loss computed on the whole
batch between the phases. 1F1B keeps at most K − k micro-batches' activations on stage k instead of M.

Each stage runs its op list in order. Sends never block; a forward waits for its input and a backward for its
output gradient (posted before the recompute, which fills the wait, as in the fill/drain schedule). Re-materialization
``except_last`` generalizes to: keep the graph of micro-batch m when its backward is the next op after its
forward (recomputing it would only delay that backward) -- every micro-batch on the last stage, which therefore
holds one micro-batch's output at a time. Deferred BatchNorm statistics are committed after the stage's last forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, get_args

import torch

from lightning_gpipe.pipe.batchnorm import check_replicas_run_the_same_m, commit_deferred_batch_norm
from lightning_gpipe.pipe.microbatch import join_input_grads, plan_sizes, split_leaves
from lightning_gpipe.pipe.records import Step
from lightning_gpipe.pipe.rng import restored_streams
from lightning_gpipe.pipe.schedule import Checkpoint, Pairs, Schedule

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)
Op = tuple[Literal["F", "B"], int]
# The last stage's loss of one micro-batch: (its output, m) -> a scalar tensor to back-propagate.
LossFn = Callable[[Any, int], torch.Tensor]


def validate_schedule(name: str) -> ScheduleName:
    for valid in SCHEDULES:
        if name == valid:
            return valid
    raise ValueError(f"schedule={name!r} is not one of {list(SCHEDULES)}")


def gpipe_ops(k: int, K: int, M: int) -> list[Op]:
    """Stage k's ops under GPipe: every forward, then every backward (the last stage: each right after its forward)."""
    if k == K - 1:
        return [op for m in range(M) for op in (("F", m), ("B", m))]
    return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]


def one_f_one_b_ops(k: int, K: int, M: int) -> list[Op]:
    """Stage k's ops under 1F1B: min(M, K − k) forwards, then a backward and a forward by turns, then the rest."""
    warm_up = min(M, K - k)
    ops: list[Op] = [("F", m) for m in range(warm_up)]
    for m in range(M):
        ops.append(("B", m))
        if warm_up + m < M:
            ops.append(("F", warm_up + m))
    return ops


OPS: dict[ScheduleName, Callable[[int, int, int], list[Op]]] = {"gpipe": gpipe_ops, "1f1b": one_f_one_b_ops}


def keeps_graph(mode: Checkpoint, ops: list[Op], m: int) -> bool:
    """Whether micro-batch m keeps its inner activations from its forward to its backward (else: recomputed)."""
    if mode != "except_last":
        return mode == "never"
    at = ops.index(("F", m))
    return ops[at + 1] == ("B", m)


def forward_backward(
    s: Schedule,
    input: Any,
    chunks: int,
    loss_fn: LossFn,
    schedule: ScheduleName,
    drained: Callable[[], None] | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch on stage ``s.index``, in ``schedule``'s order (drawn above).

    ``input`` is used on stage 0 only. The last stage calls ``loss_fn(output_m, m)`` for each micro-batch and
    back-propagates the scalar it returns at once; it returns those scalars, detached (the others return []).
    ``drained`` runs once this stage's gradients are complete, before the check that every stage finished;
    ``before_last_backward`` right before this stage's last backward op (after which its gradients are final).
    """
    seed = s.seeds.draw()
    losses: list[torch.Tensor] = []
    with s.failures.phase("train", "last") as where, restored_streams(s.device):
        sizes = plan_sizes(input, chunks, s.batch_dim) if s.is_first else []
        micro_inputs, input_leaves = split_leaves(input, sizes, s.batch_dim) if s.is_first else ([], [])
        could_require = any(p.requires_grad for p in s.layers.parameters())
        step = Step([], input_leaves=input_leaves, seed=seed)
        s.stateful_buffers.begin()
        ops = OPS[schedule](s.index, s.num_stages, len(sizes)) if s.is_first else None
        input_grads: list[list[torch.Tensor]] = [[] for _ in sizes]

        def roots(y: Any, marks: list[bool], m: int) -> Pairs:
            with s.timeline.record("loss", m):
                loss = loss_fn(y, m)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"the loss of micro-batch {m} must be a scalar tensor, got {_describe(loss)}")
            losses.append(loss.detach())
            return [(loss, None)] if loss.requires_grad else []

        pos = 0
        while ops is None or pos < len(ops):
            kind, m = ops[pos] if ops is not None else ("F", 0)
            where[0] = m
            if kind == "F":
                if s.is_first:
                    x, n, M = micro_inputs[m], sizes[m], len(sizes)
                else:
                    x, got = s.peers().receive(m, training=True)
                    M, n, step.seed = got["M"], got["n"], got["seed"]
                if ops is None:  # the first header told this stage M
                    ops = OPS[schedule](s.index, s.num_stages, M)
                    input_grads = [[] for _ in range(M)]
                if m == 0:
                    check_replicas_run_the_same_m(s.layers, M, s.device)
                keep = keeps_graph(s.checkpoint, ops, m)
                s.forward_micro(step, x, m, M, n, not keep, could_require)
                if not keep:
                    step.micro[m].output = None  # the last stage too: recomputed right before its backward
                if m == M - 1:
                    commit_deferred_batch_norm(s.layers)
            else:
                if before_last_backward is not None and ops is not None and pos == len(ops) - 1:
                    before_last_backward()
                s.backward_micro(step, m, input_grads, partial(roots, m=m))
            pos += 1
        where[0] = None
        if s.is_first and step.input_leaves:
            torch.autograd.backward(step.input_leaves, join_input_grads(input_grads, s.batch_dim))
        if drained is not None:
            drained()
        if s.links is not None:
            with s.timeline.record("status"):
                s.links.check_status()
    if s.links is not None:
        s.links.transport.wait_sends()
    return losses


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
