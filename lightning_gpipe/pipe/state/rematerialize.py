"""Re-materialization (GPipe, section 2.3): which micro-batches keep their activations, and what a recompute replays.

A checkpointed micro-batch keeps only its input (the stage boundary); its backward first re-runs ("R") its forward
from that input, started before its output gradient arrives, so that recomputing fills time otherwise spent waiting.
Its first forward runs, on an accelerator, in the recompute's grad mode with nothing saved (so that both choose the
same kernels), on the CPU without autograd (:func:`first_forward`). The modes (``Checkpoint``): ``always`` recomputes
every micro-batch; ``except_last`` (default) keeps the graph of a micro-batch whose backward is the rank's next action
after its forward (``schedule.registry.keeps_graph``), as recomputing it would only delay that backward -- in GPipe's
fill/drain the last micro-batch, under 1F1B every one on the last stage; ``never`` keeps every graph (fastest, most
memory). Autocast is captured at the forward and replayed at the recompute; :func:`is_recomputing` tells a layer with
state which of the two runs it is in.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch

# Which micro-batches keep their graph (the module's docstring): none, those whose backward follows at once, or all.
Checkpoint = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[Checkpoint, ...] = get_args(Checkpoint)

_local = threading.local()


def is_recomputing() -> bool:
    """True while a stage re-runs a checkpointed micro-batch in the backward phase (``lightning_gpipe.pipe``).

    For authors of layers with state. A checkpointed micro-batch runs its forward twice: once in the forward
    phase, once more ("recompute") just before its backward, and the two must compute the same thing. Buffers the
    forward changes (a counter, an EMA of activations, non-deferred BatchNorm statistics) are handled for you: the
    stage notices which buffers its layers change, runs each recompute on a copy of them as they were before that
    micro-batch's forward, and puts the real ones back afterwards, so each micro-batch updates them exactly once
    (M updates per mini-batch, as M separate forward calls would; not 2M-1). See
    ``GPipeStage.buffers_changed_in_forward``. Anything else a forward does to the outside world (Python
    attributes, counters on ``self`` that are not buffers, logging, appending to a list, collectives) is not
    undone: guard it with ``if not is_recomputing(): ...``, as :class:`DeferredBatchNorm` does for its statistics.
    """
    return getattr(_local, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = previous


def drop(tensor: torch.Tensor) -> None:
    """The pack hook of :func:`discarded_graph`: nothing is saved."""
    return None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("the forward-phase graph of a checkpointed micro-batch was back-propagated; it is recomputed")


@contextlib.contextmanager
def discarded_graph() -> Iterator[None]:
    """Grad enabled, as in the recompute, but autograd keeps no tensor for a backward (as torch.utils.checkpoint's
    non-reentrant forward does)."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(drop, _never_unpacked):
        yield


def first_forward(device: torch.device, compiled: bool = False) -> contextlib.AbstractContextManager:
    """The forward phase of a micro-batch that will be recomputed. On an accelerator PyTorch may choose a kernel by
    whether the inputs require grad (an attention backend, and with it the dropout stream and the rounding), so the
    forward runs in the recompute's grad mode with nothing saved (:func:`discarded_graph`): the recompute then repeats
    it. So does a compiled layer's, whose graph depends on the grad mode (``pipe/run/compiled.py``). On the CPU
    otherwise the choice does not depend on it and the graph would cost 1–4 % of a step (``benchmarks/README.md``):
    ``no_grad``."""
    return torch.no_grad() if device.type == "cpu" and not compiled else discarded_graph()


@dataclass
class ForwardState:
    """What a recompute must restore so that it repeats the forward bit for bit: the autocast state and the default
    dtype (Lightning's ``"64-true"`` and ``"bf16-true"`` set it around ``training_step`` only, and the backward, which
    recomputes, runs outside: a tensor a layer makes without a dtype would change, and a compiled layer recompile).

    The layers' randomness needs nothing saved: the stage reseeds each layer from (step seed, micro-batch, its name)
    before it runs, in the forward and in the recompute alike (see ``rng``).
    """

    cuda_devices: list[int]  # the CUDA generators that reseeding during the recompute must leave as it found them
    autocast: dict[str, tuple[bool, torch.dtype]]
    default_dtype: torch.dtype = torch.float32

    @classmethod
    def capture(cls, devices: list[torch.device]) -> ForwardState:
        cuda_devices = [d.index for d in devices if d.type == "cuda" and d.index is not None]
        autocast = {
            t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in ("cpu", "cuda")
            if t == "cpu" or torch.cuda.is_available()
        }
        return cls(cuda_devices, autocast, torch.get_default_dtype())

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        """Run the block with the captured autocast state and default dtype; the caller's RNG streams and default
        dtype are left untouched."""
        before = torch.get_default_dtype()
        with torch.random.fork_rng(devices=self.cuda_devices), contextlib.ExitStack() as stack:
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            torch.set_default_dtype(self.default_dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(before)
