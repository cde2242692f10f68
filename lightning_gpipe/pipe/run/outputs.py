"""The pipeline's output: joined on the last stage, shared with the others, and its gradient split per micro-batch."""

from __future__ import annotations

from typing import Any

import torch

from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.comm.links import Links
from lightning_gpipe.pipe.comm.transport import OUTPUT_TAG
from lightning_gpipe.pipe.microbatch import detached, join, split_by_sizes, tensors
from lightning_gpipe.pipe.run.records import OutputMode, Placeholder, Step


def join_outputs(step: Step, batch_dim: int) -> Any:
    """The last stage's micro-batch outputs joined into one detached output whose leaves collect the gradient."""
    outs = [detached(mb.output) for mb in step.micro]
    for mb in step.micro:
        if mb.state is not None:
            mb.output = None  # recomputed in the backward phase
    joined = join(outs, batch_dim, step.sizes)
    # One set of marks for the joined output; the per-micro-batch marks may differ (a checkpointed micro-batch
    # can only guess which outputs will need a gradient), and the gradient split must line up with all of them.
    marks = [any(col) for col in zip(*(mb.marks for mb in step.micro))]
    for mb in step.micro:
        mb.marks = marks
    for t, mark in zip(tensors(joined), marks):
        t.requires_grad_(mark)
    step.output = joined
    return joined


def share_output(
    output: Any, mode: OutputMode, links: Links | None, K: int, device: torch.device, last: int | None = None
) -> Any:
    """``mode="all"``: every rank of the K gets the output of the last stage (on rank ``last``, default K − 1), so
    all can compute the same loss. ``"placeholder"``: the others get zeros of its structure, shapes and dtypes (a
    header, no tensor data); ``"first"``: rank 0 gets the output, the others such zeros (predictions, kept on rank
    0, which holds the last stage too in a V)."""
    last = K - 1 if last is None else last
    if mode == "last" or K == 1:
        return output
    assert links is not None, "a pipeline of several stages has links"
    if links.index == last:
        marks, hollow = [t.requires_grad for t in tensors(output)], tree_map(Placeholder.of, output)
        for dst in (k for k in range(K) if k != last):
            if mode == "all" or (mode == "first" and dst == 0):
                links.send(dst, output, -1, requires_grad=marks, tag=OUTPUT_TAG)
            else:
                links.send(dst, hollow, -1, tag=OUTPUT_TAG)
        return output
    shared = links.receive_output(last)
    return tree_map(lambda leaf: leaf.zeros(device) if isinstance(leaf, Placeholder) else leaf, shared)


def output_grads(step: Step, grad_output: Any, batch_dim: int) -> list[list[torch.Tensor]]:
    """The gradient of the joined output (``grad_output``, or its leaves' ``.grad``), split per micro-batch."""
    leaves = tensors(step.output)
    given = tensors(grad_output) if grad_output is not None else [t.grad for t in leaves]
    # Zeros only for outputs that need a gradient and did not get one (unused by the loss).
    grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(leaves, given) if t.requires_grad]
    return [list(g) for g in split_by_sizes(grads, step.sizes, batch_dim)]
