"""What a layer or a loss may ask while the pipeline runs it: which micro-batch of which step, and its loss's weight.

Most layers need neither: a micro-batch is a batch. A layer whose loss term is not a mean over samples (a mixture of
experts' load-balancing loss: a product of two means over the whole mini-batch) needs to know that it sees micro-batch
m of M of one step, and its loss how the pipeline weights it: ``lightning_gpipe.hf`` uses both for the routers'
auxiliary loss. The state is thread-local, as the engine's other flags (``is_recomputing``) are.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

_local = threading.local()
_steps = itertools.count()


@dataclass(frozen=True)
class MicroBatchInfo:
    """Micro-batch ``m`` of ``M`` of the step numbered ``step`` (unique in the process), on this rank's stage."""

    step: int
    m: int
    M: int


def new_step() -> int:
    """A number no other step of this process has: what :attr:`MicroBatchInfo.step` tells steps apart by."""
    return next(_steps)


def current_micro_batch() -> MicroBatchInfo | None:
    """The micro-batch the stage runs now (its forward, its recompute, or on the last stage its loss); None outside
    a pipelined training step."""
    return getattr(_local, "micro_batch", None)


@contextlib.contextmanager
def running(info: MicroBatchInfo) -> Iterator[None]:
    """The engine's: :func:`current_micro_batch` is ``info`` inside."""
    previous = current_micro_batch()
    _local.micro_batch = info
    try:
        yield
    finally:
        _local.micro_batch = previous


# Outside any pipelined loss: the loss is the whole batch's (weight 1).
_WHOLE = (False, 1.0)


def pipelined_loss() -> tuple[bool, float | None]:
    """``(inside, weight)``: whether the loss being computed is one micro-batch's part of a pipelined step's loss
    (True also while the strategy re-checks that the parts add up), and the weight the pipeline gives it in the
    step's loss (the step's loss is the sum of ``weight × loss`` over its micro-batches; None during the re-check,
    which computes values only)."""
    return getattr(_local, "loss", _WHOLE)


@contextlib.contextmanager
def weighted_loss(weight: float | None) -> Iterator[None]:
    """The strategy's, around ``pipeline_loss`` per micro-batch: :func:`pipelined_loss` is ``(True, weight)``."""
    previous = pipelined_loss()
    _local.loss = (True, weight)
    try:
        yield
    finally:
        _local.loss = previous
