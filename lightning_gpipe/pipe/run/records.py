"""What a stage keeps of a step in flight: its micro-batches, boundaries, and the output's placeholders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from lightning_gpipe.pipe.comm.framing import TensorMeta
from lightning_gpipe.pipe.context import new_step
from lightning_gpipe.pipe.state.rematerialize import ForwardState


@dataclass
class MicroBatch:
    input: Any  # the stage boundary: a structure of leaves, the only thing a checkpointed micro-batch keeps
    output: Any  # the graph-carrying output; None for a checkpointed micro-batch once it was sent
    state: ForwardState | None  # the autocast state to replay; None when not checkpointed
    marks: list[bool]  # which output tensors the next stage differentiates (and sends a gradient for)
    metas: list[TensorMeta] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] | None = None  # checkpointed: what the recompute restores (see buffers.py)
    # Long skips (see skips.py), by the stage they came from or go to: received ones are part of the boundary.
    skips_in: dict[int, list[Any]] = field(default_factory=dict)
    skips_out: dict[int, list[Any]] = field(default_factory=dict)  # graph-carrying; dropped like ``output``
    skip_marks: dict[int, list[bool]] = field(default_factory=dict)
    skip_metas: dict[int, list[TensorMeta]] = field(default_factory=dict)


@dataclass
class Step:
    micro: list[MicroBatch]
    input_leaves: list[Any] = field(default_factory=list)  # stage 0: the caller's input tensors needing a gradient
    output: Any = None  # last stage: the joined output, whose leaves collect the caller's gradient
    sizes: list[int] = field(default_factory=list)  # n of each micro-batch, stage 0's split
    seed: int = 0  # the phase's step seed (stage 0's): micro-batch m's layers draw from mix(seed, m)
    key: int = field(default_factory=new_step)  # pipe.context's number of this step
    M: int = 0  # micro-batches in the step, once the first forward knows


@dataclass(frozen=True)
class Placeholder:
    """What a tensor of the output is, without its data: ``output="placeholder"`` sends this instead."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(leaf: Any) -> Any:
        return Placeholder(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf

    def zeros(self, device: torch.device) -> torch.Tensor:
        """Zeros of the output's shape that hold one element: every index reads it (an in-place write raises)."""
        return torch.zeros((), dtype=self.dtype, device=device).expand(self.shape)


OutputMode = Literal["last", "all", "placeholder", "first"]
OUTPUT_MODES: tuple[OutputMode, ...] = get_args(OutputMode)
