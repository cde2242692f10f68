"""Compiled layers: ``torch.compile`` per backbone layer on its stage, the samples' dimension dynamic, graphs counted.

A pipeline runs its layers one at a time, on micro-batches, so a layer is what compiles (as torchtitan compiles each
Transformer block): ``GPipeStage(compile=True)`` (or a dict of ``torch.compile``'s options) compiles each layer of
the stage in place (``nn.Module.compile``: the layer, its names and its state-dict keys stay as they are); layers a
user compiled (``layer.compile()``, ``torch.compile(layer)``) run as they are. What the engine does for them:

* The first forward of a micro-batch that will be recomputed runs in the recompute's grad mode with nothing saved
  (``rematerialize.discarded_graph``), on the CPU too: dynamo compiles a graph per grad mode, and a forward without
  grad would compile a second one, whose random ops inductor may draw in another order than the recompute's.
* Before each call the samples' dimension of the layer's input tensors is marked dynamic
  (``torch._dynamo.maybe_mark_dynamic``): a short last micro-batch runs the graph of the others. A dimension that
  changes otherwise (a sequence length) becomes dynamic at its second value, as dynamo makes it by itself. A
  micro-batch of one sample compiles a graph of its own (dynamo specializes sizes 0 and 1).
* Each layer's graphs are counted (dynamo's count of graphs compiled, read around the layer's call). Where dynamo
  reaches ``torch._dynamo.config.recompile_limit`` during a layer's call, and from then on runs that code
  uncompiled, a warning names the layer and its input's shapes (dynamo's own names only a function). The limit
  counts per code object: layers of one class share it, and so do all of torch.nn's own classes compiled in place
  (dynamo enters them through one wrapper). ``compile_layers`` raises it to three graphs per layer it compiles.

* A deferred BatchNorm inside a compiled layer defers its statistics through stand-in buffers swapped in around the
  layer's call (``pipe/state/stand_ins.py``) instead of eager deferral's interception, which breaks graphs.

The layers that stash or pop long skips (``pipe/skips.py``) run eagerly under the shorthand (a warning names them),
and are refused compiled by hand: the tray hands them each micro-batch's skips through Python state.

Refused, with the way out: the zero-bubble schedules' split backward (it routes each op of a layer's forward through
a torch-function mode that a compiled graph does not run), and a compiled ``nn.Sequential`` backbone (its layers run
one by one on their stages, never as the whole).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

from lightning_gpipe.pipe._torch_internals import (
    RECOMPILE_LIMIT_LOGGER,
    graphs_compiled,
    is_optimized_module,
    tree_flatten,
)
from lightning_gpipe.pipe.schedule.registry import ScheduleName, lookup
from lightning_gpipe.pipe.state.stand_ins import deferred_norms, standing_in

CompileOptions = bool | dict[str, Any]


def compile_options(compile: CompileOptions) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for each layer (None: compile nothing); a clear error for a bad value."""
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, dict):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile's options (e.g. {{'mode': 'max-autotune'}}), "
            f"got {type(compile).__name__}"
        )
    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    if unknown := sorted(set(compile) - known):
        raise ValueError(f"compile={compile!r}: {unknown} are not torch.compile's options; it takes {sorted(known)}")
    return dict(compile)


def compile_layers(layers: dict[str, nn.Module], options: dict[str, Any] | None, skip_holders: set[str]) -> None:
    """Compile each layer in place with ``options`` (None: none), but those compiled already and those that stash or
    pop a long skip (``pipe/skips.py``: the tray hands each micro-batch's skips through Python state, which a graph
    would fix at its first call). Those stay eager, named in one warning; a user's compiled one is refused."""
    eager, compiled = [], 0
    for name, layer in layers.items():
        if name not in skip_holders:
            if options is not None and not is_compiled(layer):
                layer.compile(**options)
                compiled += 1
        elif is_compiled(layer):
            raise TypeError(
                f"layer {name} ({type(layer).__name__}) is compiled, but it stashes or pops a long skip: the pipeline "
                "hands each micro-batch's skips to it through Python state that a compiled graph would fix at its "
                "first call. Compile the layers around it, or the modules inside it that do not stash or pop"
            )
        elif options is not None:
            eager.append(f"{name} ({type(layer).__name__})")
    # Dynamo's limit counts the graphs of one code object: the layers of a class (all of torch.nn's classes, too)
    # share it. Room for three graphs a layer (training, eval, and a micro-batch of one sample), raised, never lowered.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * compiled)
    if eager:
        warnings.warn(
            f"compile=: layers {', '.join(eager[:4])}{', …' if len(eager) > 4 else ''} run eagerly: they stash or pop "
            "a long skip, whose per-micro-batch Python state a graph cannot hold",
            stacklevel=3,
        )


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it runs compiled (``torch.compile(m)`` or ``m.compile()``)."""
    return any(is_optimized_module(m) or m._compiled_call_impl is not None for m in module.modules())


def check_backbone(module: nn.Module, where: str) -> None:
    """A compiled backbone container is refused: the pipeline calls its layers, never it."""
    if is_optimized_module(module) or module._compiled_call_impl is not None:
        raise TypeError(
            f"{where}: the nn.Sequential backbone itself is compiled, but a pipeline runs its layers one by one on "
            "their stages and never calls it, so it would run uncompiled: compile its layers instead, with "
            "compile=True (or a dict of torch.compile's options) or layer.compile() on each"
        )


def splits(schedule: str) -> bool:
    """Whether ``schedule`` splits each backward into I and W (the zero-bubble schedules)."""
    spec = lookup(schedule)
    return any(a.kind == "W" for ops in spec.actions(*spec.example) for a in ops)


def check_schedule(schedule: ScheduleName, compiled: list[str]) -> None:
    if compiled and splits(schedule):
        raise ValueError(
            f"schedule={schedule!r} splits each backward op by op (the weight gradients of linear, convolution and "
            f"embedding ops wait for W), which compiled layers ({', '.join(compiled[:3])}"
            f"{', …' if len(compiled) > 3 else ''}) cannot do: their backward is one graph. Use schedule='1f1b' or "
            "'interleaved-1f1b' (their bubble without the deferred weight gradients), or run the layers eagerly"
        )


class _LimitHeard(logging.Handler):
    """Dynamo's warnings that a code object reached its recompile limit, while a compiled layer runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.heard: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message:
            self.heard.append(message.splitlines()[0])


class Compilations:
    """The graphs dynamo compiled for each compiled layer of a stage, and their calls with the samples' dimension
    marked dynamic (the module's docstring)."""

    def __init__(self, layers: dict[str, nn.Module], batch_dim: int) -> None:
        self.names = [name for name, layer in layers.items() if is_compiled(layer)]
        self._compiled = set(self.names)
        self._batch_dim = batch_dim
        self._norms = {name: deferred_norms(layers[name]) for name in self.names}
        self.graphs: Counter[str] = Counter()
        self._limit = _LimitHeard()

    def __contains__(self, name: str) -> bool:
        return name in self._compiled

    def call(self, name: str, layer: nn.Module, x: Any) -> Any:
        """``layer(x)``, layer ``name`` being compiled."""
        inputs = [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]
        for t in inputs:
            if t.dim() > self._batch_dim:
                torch._dynamo.maybe_mark_dynamic(t, self._batch_dim)
        logger, before = logging.getLogger(RECOMPILE_LIMIT_LOGGER), graphs_compiled()
        logger.addHandler(self._limit)
        try:
            with standing_in(self._norms[name]):
                y = layer(x)
        finally:
            logger.removeHandler(self._limit)
        self.graphs[name] += graphs_compiled() - before
        if self._limit.heard:
            heard, self._limit.heard = self._limit.heard, []
            warnings.warn(
                f"layer {name!r} stopped compiling at input shapes {[tuple(t.shape) for t in inputs]}, after "
                f"{self.graphs[name]} graphs: {heard[0]}. Dynamo runs that code uncompiled from now on, for every "
                "layer that shares it (nn.Module.compile runs torch.nn's own layer classes through one function). "
                "Mark the dimension that changes dynamic (torch._dynamo.mark_dynamic on the input), give inputs "
                "fewer distinct shapes (pad to a few lengths), or raise torch._dynamo.config.recompile_limit",
                stacklevel=2,
            )
        return y
