"""The GPipe fill/drain order of one mini-batch on each stage, and which micro-batches are re-materialized.

K = 3 stages, M = 4 micro-batches, ``checkpoint="except_last"``; F m = forward of micro-batch m, R m = its
recompute, B m = its backward, L = the user's loss; time runs to the right, one column per unit of work:

            t  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    stage 0 | F0 F1 F2 F3 .  .  .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 1 |    F0 F1 F2 F3 .  .  .  B3 R2 B2 R1 B1 R0 B0
    stage 2 |       F0 F1 F2 F3 L  B3 R2 B2 R1 B1 R0 B0

Forward phase: stage k receives micro-batch m from stage k-1 (stage 0 splits the input), runs its layers and sends
the result to stage k+1 at once, without waiting for it to be received. A checkpointed micro-batch runs without
autograd and keeps only its input (the stage boundary); the others keep their graph.

Backward phase, in reverse order: stage k first posts the receive for m's output gradient, then re-runs ("R")
micro-batch m from its saved input -- before the gradient arrives, so recomputation fills time that would otherwise
be spent waiting (GPipe, section 2.3) -- then waits for the gradient, back-propagates ("B") and sends the input
gradient to stage k-1 at once: stage k's R m runs while stage k+1 runs B m (t = 9, 11, 13 above). The idle
triangles ('.') are the bubble, (K-1)/(M+K-1) of the time when every unit costs the same.

Re-materialization modes: ``always`` checkpoints every micro-batch; ``except_last`` (default) keeps the graph of the
last one, whose backward comes first, so recomputing it would only delay the drain (no R3 above);
``never`` keeps every graph (fastest, most memory).
"""

from __future__ import annotations

from typing import Literal

Checkpoint = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")


def validate_checkpoint(mode: str) -> Checkpoint:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={mode!r} is not one of {list(CHECKPOINT_MODES)}")
    return mode  # type: ignore[return-value]


def is_checkpointed(mode: Checkpoint, m: int, M: int) -> bool:
    """Whether micro-batch m of M drops its inner activations in the forward phase and is recomputed later."""
    if mode == "always":
        return True
    if mode == "except_last":
        return m < M - 1
    return False


def forward_order(M: int) -> range:
    return range(M)


def backward_order(M: int) -> range:
    return range(M - 1, -1, -1)
