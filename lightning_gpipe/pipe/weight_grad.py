"""Zero-bubble's split backward: the weight gradients of linear, convolution and embedding ops deferred to a W action.

As Megatron-LM's and DualPipe's ``WeightGradStore``: while a micro-batch of a split schedule ("zb-h1") runs forward
(or is recomputed), the split ops (``split_ops``) compute each op's input gradient in I and keep (input, output
gradient) in a closure for micro-batch m; W m runs m's closures and accumulates the results with the autograd
engine (``torch.autograd.backward``'s) on the parameters themselves, so that ``.grad`` sums exactly as autograd sums
it and the parameters' hooks fire once, at W.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_gpipe.pipe._torch_internals import accumulate_grads
from lightning_gpipe.pipe.split_ops import Closure, Deferring, trainable_leaf


class WeightGrads:
    """One step's deferred weight gradients, per micro-batch: collected in I, accumulated in W.

    The mode runs only inside the calls of ``layers``' modules that hold a trainable matrix (or higher) themselves,
    as the weights of the split ops are (a Linear, a convolution, an embedding, an attention's packed projection): a
    torch-function mode costs a Python call per op, which the other ops (activations, norms with their vectors,
    attention's arithmetic, containers) do not pay; an op the mode does not see runs as written, its gradients in I.
    Their hooks (entering it after the module's own pre-hooks, leaving it before its own hooks, so that modes those
    enter nest) live until :meth:`close`, for one step.
    """

    def __init__(self, layers: nn.Module) -> None:
        self._pending: dict[int, list[Closure]] = {}
        self._current: Deferring | None = None  # the mode of the micro-batch in progress, entered in each module
        self._mode: Deferring | None = None  # it, while entered
        self._entered: list[bool] = []  # per module call in progress: whether it entered the mode
        self._handles: list[RemovableHandle] = []
        for module in layers.modules():
            if any(p is not None and trainable_leaf(p) and p.dim() >= 2 for p in module._parameters.values()):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave, prepend=True, always_call=True))

    def close(self) -> None:
        """Remove the hooks (at the end of the step, or when it fails)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        mode = self._current if self._mode is None else None  # entered once, in the outermost module holding weights
        if mode is not None:
            self._mode = mode
            mode.__enter__()
        self._entered.append(mode is not None)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._entered and self._entered.pop() and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @contextlib.contextmanager
    def deferring(self, m: int) -> Iterator[None]:
        """Around micro-batch m's forward and its recompute: the split ops' weight gradients wait for :meth:`run`."""
        sink: list[Closure] = []
        self._pending[m] = sink  # a recompute's graph replaces the forward's (whose backward never runs)
        self._current = Deferring(sink)
        try:
            yield
        finally:
            self._current = None

    def run(self, m: int) -> None:
        """W m: micro-batch m's weight gradients into ``.grad``, as autograd accumulates them (hooks included)."""
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for closure in self._pending.pop(m, []):
            for p, g in closure():
                # A parameter used twice: its gradients summed in the order autograd's input buffer sums them, in
                # the dtype autocast computed them in (its cast of a weight is cached: one cast, one sum before it).
                grads[id(p)] = (p, g) if id(p) not in grads else (p, grads[id(p)][1] + g)
        if grads:
            params, values = [p for p, _ in grads.values()], [g.to(p.dtype) for p, g in grads.values()]
            grads.clear()
            accumulate_grads(params, values)
