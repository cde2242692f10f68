"""GPipe's fill/drain phases (the loss outside the pipeline, between them) and the forward-only pass, drawn here.

K = 3 stages, M = 4 micro-batches, ``checkpoint="except_last"``; F m = forward of micro-batch m, R m = its
recompute, B m = its backward, L = the user's loss; time runs to the right, one column per unit of work:

            t  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    stage 0 | F0 F1 F2 F3 .  .  .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 1 |    F0 F1 F2 F3 .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 2 |       F0 F1 F2 F3 L  B3 R2 B2 R1 B1 R0 B0

Forward phase: stage k receives micro-batch m from stage k-1 (stage 0 splits the input), runs its layers and sends
the result to stage k+1 at once, without waiting for it to be received. A checkpointed micro-batch keeps only its
input (the stage boundary; ``pipe/state/rematerialize.py``); the others keep their graph.

Backward phase, in reverse order: stage k first posts the receive for m's output gradient, then re-runs ("R")
micro-batch m from its saved input -- before the gradient arrives, so recomputation fills time that would otherwise
be spent waiting (GPipe, section 2.3) -- then waits for the gradient, back-propagates ("B") and sends the input
gradient to stage k-1 at once: stage k's R m runs while stage k+1 runs B m (t = 9, 11, 13 above). The idle
triangles ('.') are the bubble, (K-1)/(M+K-1) of the time when every unit costs the same.

Under ``except_last`` the last micro-batch keeps its graph: its backward comes first (no R3 above).

With v virtual stages per rank (``virtual_stages``: rank r holds stages r, r + K, …) the phases run the rank's virtual
stages one after the other, each as above: a forward phase around the ring v times (rank K − 1 hands micro-batch m of
chunk c to rank 0's chunk c + 1), a backward phase back, the last chunk first. In a V (rank r holds stages r and
2K − 1 − r) the forward phase goes down the ranks and back up (rank K − 1 hands each micro-batch from its chunk a to
its chunk b in the process) and the last stage is on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch

from lightning_gpipe.pipe.microbatch import join, join_input_grads, plan_sizes, split_by_sizes, split_leaves, tensors
from lightning_gpipe.pipe.run.executor import Executor, marked_pairs, settle, wait_sends
from lightning_gpipe.pipe.run.outputs import join_outputs, output_grads, share_output
from lightning_gpipe.pipe.run.records import OutputMode, Step
from lightning_gpipe.pipe.split.boundary import check_boundary
from lightning_gpipe.pipe.state.batchnorm import (
    check_replicas_run_the_same_m,
    commit_deferred_batch_norm,
    deferred_statistics,
)
from lightning_gpipe.pipe.state.rematerialize import Checkpoint
from lightning_gpipe.pipe.state.rng import mix, restored_streams


def is_checkpointed(mode: Checkpoint, m: int, M: int) -> bool:
    """Whether micro-batch m of M drops its inner activations in the forward phase and is recomputed later."""
    if mode == "always":
        return True
    if mode == "except_last":
        return m < M - 1
    return False


def backward_order(M: int) -> range:
    return range(M - 1, -1, -1)


def _micro_batches(
    s: Executor, inputs: Sequence[Any], sizes: Sequence[int], M: int, training: bool, where: list
) -> Iterator[tuple[int, Any, int, dict[str, Any] | None]]:
    """Chunk ``s``'s micro-batches in order, as (m, input, its size n, the received header's fields or None): the
    first stage's from this rank's split input, another's received from the stage before, whose first header tells
    how many there are; ``where`` names the one in progress for the failure handler."""
    m = 0
    while m < M or (m == 0 and not s.is_first):
        where[:] = m, s.place
        if s.is_first:
            yield m, inputs[m], sizes[m], None
        else:
            x, got = s.receive(m, training=training)
            M = got["M"]
            if m + 1 < M:  # the next receive from that rank: its bytes may move while this one computes
                s.receive_ahead(m + 1)
            yield m, x, got["n"], got
        m += 1


def forward_phase(executors: Sequence[Executor], input: Any, M: int, output_mode: OutputMode) -> tuple[list[Step], Any]:
    """The forward phase: every micro-batch through this rank's stages (``executors``, in order), each in order; returns
    the step of each chunk and the output."""
    first = executors[0]
    seed = first.seeds.draw()
    batch_dim = first.batch_dim
    steps = []
    with first.failures.phase("forward", output_mode) as where, restored_streams(first.device):
        sizes = plan_sizes(input, M, batch_dim) if first.is_first else []
        micro_inputs, input_leaves = split_leaves(input, sizes, batch_dim) if first.is_first else ([], [])
        M = len(micro_inputs)
        for s in executors:
            could_require = any(p.requires_grad for p in s.layers.parameters())
            step = Step([], input_leaves=input_leaves if s.is_first else [], seed=seed)
            s.stateful_buffers.begin()
            for m, x, n, got in _micro_batches(s, micro_inputs, sizes, M, True, where):
                if got is not None:
                    M, step.seed = got["M"], got["seed"]
                if m == 0:
                    check_replicas_run_the_same_m(s.layers, M, s.device)
                s.forward_micro(step, x, m, M, n, is_checkpointed(s.checkpoint, m, M), could_require)
            commit_deferred_batch_norm(s.layers)
            steps.append(step)
        where[:] = None, None  # the output's sharing is no micro-batch's
        output = join_outputs(steps[-1], batch_dim) if executors[-1].is_last else None
        output = share_output(output, output_mode, first.links, first.ranks, first.device, first.last_rank)
        settle(first, where, status=output_mode == "last")  # else the shared output told how the phase ended
    return steps, output


def backward_phase(
    executors: Sequence[Executor],
    steps: Sequence[Step],
    grad_output: Any,
    output_mode: OutputMode,
    drained: Callable[[], None] | None = None,
) -> None:
    """The backward phase: the micro-batches of each chunk's step in reverse, the last chunk first, each recomputed
    first if checkpointed; ``drained`` runs once this rank's gradients are complete, before the status check waits
    for the others."""
    first = executors[0]
    with first.failures.phase("backward", output_mode) as where:
        for s, step in reversed(list(zip(executors, steps))):
            last_grads = output_grads(step, grad_output, s.batch_dim) if s.is_last else None
            input_grads: list[list[torch.Tensor]] = [[] for _ in step.micro]
            for m in backward_order(len(step.micro)):
                where[:] = m, s.place
                grads = last_grads[m] if last_grads is not None else []
                s.backward_micro(step, m, input_grads, partial(marked_pairs, grads=grads))
            if s.is_first and step.input_leaves:
                torch.autograd.backward(step.input_leaves, join_input_grads(input_grads, s.batch_dim))
        settle(first, where, drained)
    wait_sends(first)


def evaluate(
    executors: Sequence[Executor], input: Any, M: int, output_mode: OutputMode, head: Callable[[Any], Any] | None = None
) -> Any:
    """A forward-only pipeline (no grad) through this rank's stages in order: nothing is kept for a backward phase.
    With ``head``, the last stage shares ``head(output)`` with every stage instead (``GPipeStage.output_head``)."""
    first = executors[0]
    seed = first.seeds.draw()
    batch_dim = first.batch_dim
    with (
        first.failures.phase("evaluation", output_mode) as where,
        deferred_statistics(),
        restored_streams(first.device),
    ):
        planned = plan_sizes(input, M, batch_dim) if first.is_first else []
        inputs = split_by_sizes(input, planned, batch_dim) if first.is_first else []
        M = len(inputs)
        for s in executors:
            outs, sizes = [], []
            for m, x, n, got in _micro_batches(s, inputs, planned, M, False, where):
                if got is not None:
                    M, seed = got["M"], got["seed"]
                skips_in = s.peers().receive_skips(m, s.skips, s.chunk) if s.skips and s.skips.receives else {}
                s.poll()
                with s.timeline.record("forward", m, chunk=s.chunk):
                    y, skips_out = s.run_with_skips(x, mix(seed, m), skips_in, copy=False)
                s.poll()
                check_boundary(y, n, batch_dim, s.producer, s.is_last)
                sizes.append(n)
                fields: dict[str, Any] = {"m": m, "M": M, "n": n, "training": False, "seed": seed, "stage": s.index}
                if s.is_last:
                    outs.append(y)
                else:
                    s.send_on(y, m, **fields)
                for dst, values in skips_out.items():
                    s.peers().send_skips(dst, values, [False] * len(tensors(values)), s.chunk, fields, s.routes())
            commit_deferred_batch_norm(s.layers)
        where[:] = None, None
        output = join(outs, batch_dim, sizes) if executors[-1].is_last else None
        if head is not None:
            output_mode = "all"
            output = head(output) if output is not None else None
        output = share_output(output, output_mode, first.links, first.ranks, first.device, first.last_rank)
        settle(first, where, status=output_mode == "last")
    wait_sends(first)
    return output
