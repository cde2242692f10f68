"""Zero-bubble's split backward: the weight gradients of linear, convolution and embedding ops deferred to a W action.

As Megatron-LM's and DualPipe's ``WeightGradStore``: while a micro-batch of a split schedule ("zb-h1") runs forward
(or is recomputed), the split ops (``split_ops``) compute each op's input gradient in I and keep (input, output
gradient) in a closure for micro-batch m; W m runs m's closures and accumulates each one's results with the autograd
engine (``torch.autograd.backward``'s) on the parameters themselves, so that ``.grad`` sums exactly as autograd sums
it and the parameters' hooks fire once, at W. An op splits only where the W it moves pays for the split's host
work (:func:`split_pays`).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_gpipe.pipe._torch_internals import accumulate_grads, tree_flatten, tree_map
from lightning_gpipe.pipe.run.weight_grad_ops import (
    Deferred,
    Deferring,
    autocast_dtype,
    keep_linear_grads,
    linear_weight_flops,
    saves_as_autograd,
    trainable_leaf,
)
from lightning_gpipe.pipe.schedule.split_cost import pays, w_cost
from lightning_gpipe.pipe.state.rng import cuda_devices_of

# Set (to anything but "" or "0"), every op splits, paying or not: the tests' way to run the split on tiny models.
SPLIT_EVERY_OP = "LIGHTNING_GPIPE_SPLIT_EVERY_OP"


def split_pays(
    flops: float, conv: bool, device: torch.device, K: int, M: int, dtype: torch.dtype = torch.float32
) -> bool:
    """Whether deferring one op's weight gradient (W, ``flops`` operations a micro-batch, in ``dtype``) shortens
    a zb-h1 step on K ranks and M micro-batches (``split_cost.pays``, with the op's W time and extra share from
    ``split_cost.w_cost``)."""
    if os.environ.get(SPLIT_EVERY_OP, "") not in ("", "0"):
        return True
    return pays(*w_cost(flops, conv, device, dtype), K, M)


def weight_ops(module: nn.Sequential, sample: Any) -> list[list[tuple[float, float]]]:
    """Per layer of ``module`` on ``sample`` (fed through the layers before it, as a stage's input requiring grad):
    each op a split schedule could defer, as (its W's seconds on the whole sample, its extra share) from
    ``split_cost.w_cost``, for the plan to price the split as ``split_cost.pays`` decides it. One forward under
    grad, nothing kept; buffers and the RNG streams as they were."""
    found: list[tuple[float, float]] = []

    def record(weight: torch.Tensor, flops: float, conv: bool) -> bool:
        found.append(w_cost(flops, conv, weight.device, autocast_dtype(weight.device.type) or weight.dtype))
        return False  # nothing routed: the forward runs as written

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    leaf = lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t  # noqa: E731
    x = tree_map(leaf, sample)
    per_layer = []
    cuda = cuda_devices_of(*module.parameters(), *[t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)])
    with torch.random.fork_rng(devices=cuda), torch.enable_grad(), Deferring([], record):
        for layer in module:
            x = layer(x)
            per_layer.append(list(found))
            found.clear()
    with torch.no_grad():
        for b, before in buffers:
            b.copy_(before)
    return per_layer


class _Toggled(NamedTuple):
    """A plain Linear's call in progress outside the mode: its input, parameters, and whether its W defers."""

    module: nn.Module
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    defers: bool


class WeightGrads:
    """One step's deferred weight gradients, per micro-batch: collected in I, accumulated in W.

    The mode runs only inside the calls of ``layers``' modules that hold a trainable matrix (or higher) themselves,
    as the weights of the split ops are (a Linear, a convolution, an embedding, an attention's packed projection): a
    torch-function mode costs a Python call per op, which the other ops (activations, norms with their vectors,
    attention's arithmetic, containers) do not pay; an op the mode does not see runs as written, its gradients in I.
    Their hooks (entering it after the module's own pre-hooks, leaving it before its own hooks, so that modes those
    enter nest) live until :meth:`close`, for one step. A plain ``nn.Linear`` on an input that requires grad needs
    no mode: its hooks take its parameters out of autograd for the call (``requires_grad`` off, then back on), so
    that autograd's addmm backward computes the input gradient alone, and keep the output gradient for W, as the
    mode's cheap path does, without a Python call per op.

    With ``shape=(K, M)`` an op defers its W only where that pays (:func:`split_pays`), decided per weight the first
    time the step meets it, so that a weight's gradient sums in one order all step; the hooks of a module that
    entered the mode in the step's first split forward and routed nothing are removed then. Without, every op
    defers.
    """

    def __init__(self, layers: nn.Module, shape: tuple[int, int] | None = None) -> None:
        self._pending: dict[int, list[Deferred]] = {}
        self._current: Deferring | None = None  # the mode of the micro-batch in progress, entered in each module
        self._mode: Deferring | None = None  # it, while entered
        # Per module call in progress: (it, the mode's count of routed ops) if it entered the mode, or its toggle.
        self._entered: list[tuple[nn.Module, int] | _Toggled | None] = []
        self._shape = shape
        self._pays: dict[int, bool] = {}  # by id of weight
        self._told = False  # whether the step's first forward with a graph ran (and told which modules route)
        self._calls: dict[int, bool] = {}  # in that forward, by id of module entering the mode: whether it routed
        self._handles: dict[int, tuple[RemovableHandle, RemovableHandle]] = {}  # by id of module
        self._linears: set[int] = set()  # by id of module: those that run nn.Linear's own forward
        for module in layers.modules():
            if any(p is not None and trainable_leaf(p) and p.dim() >= 2 for p in module._parameters.values()):
                if type(module).forward is nn.Linear.forward and "forward" not in module.__dict__:
                    self._linears.add(id(module))
                self._handles[id(module)] = (
                    module.register_forward_pre_hook(self._enter),
                    module.register_forward_hook(self._leave, prepend=True, always_call=True),
                )

    def close(self) -> None:
        """Remove the hooks (at the end of the step, or when it fails)."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles = {}

    @property
    def decided(self) -> tuple[int, int]:
        """How many weights the step's split ops met so far that split, and how many they met."""
        return sum(self._pays.values()), len(self._pays)

    def _decide(self, weight: torch.Tensor, flops: float, conv: bool) -> bool:
        key = id(weight)
        if key not in self._pays:
            dtype = autocast_dtype(weight.device.type) or weight.dtype  # the products' dtype
            self._pays[key] = self._shape is None or split_pays(flops, conv, weight.device, *self._shape, dtype)
        return self._pays[key]

    def _toggled(self, module: nn.Module, args: Any) -> _Toggled | None:
        """A plain Linear's call outside the mode, where it is one addmm on an input that requires grad (else the
        mode's): its parameters out of autograd for the call if its W defers."""
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        x = args[0] if len(args) == 1 else None
        if not (
            type(x) is torch.Tensor
            and x.requires_grad
            and x.dim() >= 2
            and (x.dim() == 2 or x.is_contiguous())
            and torch.is_grad_enabled()
            and weight is not None
            and trainable_leaf(weight)
            and (bias is None or trainable_leaf(bias))
            and autocast_dtype(x.device.type) is None  # the mode casts as autocast does
        ):
            return None
        defers = saves_as_autograd() and self._decide(weight, linear_weight_flops(x, weight), False)
        if defers:
            for p in (weight, bias):
                if p is not None:
                    p.requires_grad_(False)
        return _Toggled(module, x, weight, bias, defers)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._mode is None and self._current is not None and id(module) in self._linears:
            toggled = self._toggled(module, args)
            if toggled is not None:
                self._entered.append(toggled)
                return
        mode = self._current if self._mode is None else None  # entered once, in the outermost module holding weights
        if mode is not None:
            self._mode = mode
            mode.__enter__()
        self._entered.append((module, mode.routed) if mode is not None else None)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        entered = self._entered.pop() if self._entered else None
        if isinstance(entered, _Toggled):
            if entered.defers:
                for p in (entered.weight, entered.bias):
                    if p is not None:
                        p.requires_grad_(True)
                if isinstance(output, torch.Tensor) and self._current is not None:  # None: the forward raised
                    w = entered.weight.detach()
                    keep_linear_grads(output, entered.x, entered.weight, entered.bias, w, self._current.sink)
            if not self._told and self._shape is not None:
                self._calls[id(module)] = self._calls.get(id(module), False) or entered.defers
            return
        if entered is not None and self._mode is not None:
            if not self._told and self._shape is not None:  # without a shape nothing is removed: nothing to tell
                key = id(entered[0])
                self._calls[key] = self._calls.get(key, False) or self._mode.routed > entered[1]
            self._mode.__exit__(None, None, None)
            self._mode = None

    @contextlib.contextmanager
    def deferring(self, m: int) -> Iterator[None]:
        """Around micro-batch m's forward and its recompute: the split ops' weight gradients wait for :meth:`run`."""
        sink: list[Deferred] = []
        self._pending[m] = sink  # a recompute's graph replaces the forward's (whose backward never runs)
        self._current = Deferring(sink, self._decide)
        recorded = torch.is_grad_enabled()  # without a graph nothing routes, which tells nothing
        try:
            yield
        finally:
            self._current = None
            if not self._told and self._shape is not None and recorded:
                self._told = True
                for key in [key for key, routed in self._calls.items() if not routed]:
                    for handle in self._handles.pop(key, ()):
                        handle.remove()

    def run(self, m: int) -> None:
        """W m: micro-batch m's weight gradients into ``.grad``, as autograd accumulates them (hooks included).

        Each op's results go into ``.grad`` before the next op's products run, so that one op's results at a time
        are held, not the stage's (all of its weight gradients at once: on the CPU the products then wrote fresh
        memory, page by page, and W took 1.3 × its products' time; benchmarks/README.md, "zb-h1's split")."""
        deferred = self._pending.pop(m, [])
        uses = Counter(id(p) for d in deferred for p in d.params)
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a parameter used again later: its sum so far
        for d in deferred:
            ready = []
            for p, g in d.compute():
                key = id(p)
                # A parameter used twice: its gradients summed in the order autograd's input buffer sums them, in
                # the dtype autocast computed them in (its cast of a weight is cached: one cast, one sum before it).
                g = held.pop(key)[1] + g if key in held else g
                uses[key] -= 1
                if uses[key] > 0:
                    held[key] = (p, g)
                else:
                    ready.append((p, g))
            self._accumulate(ready)
        self._accumulate(list(held.values()))  # none, unless a closure returned fewer parameters than it named

    @staticmethod
    def _accumulate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if pairs:
            accumulate_grads([p for p, _ in pairs], [g.to(p.dtype) for p, g in pairs])
