"""The pipeline's output: joined on the last stage, shared with the others, and its gradient split per micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_gpipe.pipe.microbatch import detached, join, split_by_sizes, tensors
from lightning_gpipe.pipe.records import Placeholder, Step
from lightning_gpipe.pipe.transport import OUTPUT_TAG


class OutputHandling:
    """Mixed into GPipeStage: what happens to the last stage's micro-batch outputs."""

    _K: int
    _batch_dim: int
    _device: torch.device
    _output_mode: str
    _transport: Any
    timeline: Any
    is_last: bool
    _send: Callable[..., Any]

    def _join_outputs(self, step: Step) -> Any:
        outs = [detached(mb.output) for mb in step.micro]
        for mb in step.micro:
            if mb.state is not None:
                mb.output = None  # recomputed in the backward phase
        joined = join(outs, self._batch_dim, step.sizes)
        # One set of marks for the joined output; the per-micro-batch marks may differ (a checkpointed micro-batch
        # can only guess which outputs will need a gradient), and the gradient split must line up with all of them.
        marks = [any(col) for col in zip(*(mb.marks for mb in step.micro))]
        for mb in step.micro:
            mb.marks = marks
        for t, mark in zip(tensors(joined), marks):
            t.requires_grad_(mark)
        step.output = joined
        return joined

    def _share_output(self, output: Any) -> Any:
        """``output="all"``: every stage gets the last stage's output, so all can compute the same loss.
        ``"placeholder"``: the others get zeros of its structure, shapes and dtypes (a header, no tensor data)."""
        if self._output_mode == "last" or self._K == 1:
            return output
        assert self._transport is not None
        if self.is_last:
            if self._output_mode == "all":
                sent, marks = output, [t.requires_grad for t in tensors(output)]
            else:
                sent, marks = tree_map(Placeholder.of, output), None
            for dst in range(self._K - 1):
                self._send(dst, sent, -1, requires_grad=marks, tag=OUTPUT_TAG)
            return output
        with self.timeline.record("recv-wait", -1, label="output"):
            shared, _ = self._transport.recv(self._K - 1, "the pipeline's output", tag=OUTPUT_TAG)
        return tree_map(lambda leaf: leaf.zeros(self._device) if isinstance(leaf, Placeholder) else leaf, shared)

    def _output_grads(self, step: Step, grad_output: Any) -> list[list[torch.Tensor]]:
        leaves = tensors(step.output)
        given = tensors(grad_output) if grad_output is not None else [t.grad for t in leaves]
        # Zeros only for outputs that need a gradient and did not get one (unused by the loss).
        grads = [g if g is not None else torch.zeros_like(t) for t, g in zip(leaves, given) if t.requires_grad]
        return [list(g) for g in split_by_sizes(grads, step.sizes, self._batch_dim)]
