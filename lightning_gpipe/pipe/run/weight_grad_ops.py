"""The split ops of zero-bubble's backward: linear, convolution and embedding with the weight gradient as a closure.

While a micro-batch of a split schedule runs forward (or is recomputed), the torch-function mode :class:`Deferring`,
entered by ``weight_grad.WeightGrads`` inside the modules that hold parameters, routes ``F.linear``,
``F.conv1d/2d/3d`` and ``F.embedding`` whose weight is a trainable leaf, and whose W its ``decide`` says to defer (from
W's operations), through an autograd function of the same op.
Its backward (in I, the input-gradient half) computes the input gradient only, and appends to micro-batch m's list a
closure that computes the weight gradients (W) from the kept (input, output gradient), with the formulas autograd
uses. No module is swapped: the layers run their own forward. Every other parameter (norms, custom ones, a weight
used outside the module that holds it) gets its gradient in I.

Under autocast the op's arguments are cast as autocast casts them (linear and convolutions run in its lower
precision), and the deferred matmuls use those casts, as autograd's would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple, overload

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_gpipe.pipe._torch_internals import saved_tensors_pack_hook
from lightning_gpipe.pipe.state import rematerialize

# One deferred weight gradient: computes (parameter, its gradient) pairs when W runs.
Closure = Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]


class Deferred(NamedTuple):
    """One split op's W: the parameters its closure computes gradients for, and the closure."""

    params: tuple[torch.Tensor, ...]
    compute: Closure


def _deferred(weight: torch.Tensor, bias: torch.Tensor | None, compute: Closure) -> Deferred:
    return Deferred((weight,) if bias is None else (weight, bias), compute)


_CONVS = (F.conv1d, F.conv2d, F.conv3d)


def saves_as_autograd() -> bool:
    """Whether autograd saves tensors as it does by itself here, or only under the engine's forward that saves
    nothing (``rematerialize.discarded_graph``). Under anyone else's ``saved_tensors_hooks`` an op is not split: the
    non-reentrant ``torch.utils.checkpoint`` recomputes its forward in backward, outside the split, and checks that
    the recompute saves what the forward saved, which a split op does not."""
    hook = saved_tensors_pack_hook()
    return hook is None or hook is rematerialize.drop


def trainable_leaf(t: Any) -> bool:
    """Whether ``t`` is a parameter autograd accumulates into (a dense leaf that requires grad)."""
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and t.layout == torch.strided


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts linear and convolutions to on ``device_type``, or None when it is off there."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@overload
def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...
@overload
def _cast(t: None, dtype: torch.dtype | None) -> None: ...
def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """As autocast's ``cached_cast``: floating tensors other than float64 to ``dtype``, keeping ``requires_grad``
    (some kernels are chosen by it: ``matmul`` folds a 3-d input into one mm when the weight requires grad)."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    with torch.enable_grad():
        return t.to(dtype)


def _as_list(v: Any, d: int) -> list[int]:
    return [int(i) for i in v] if isinstance(v, (tuple, list)) else [int(v)] * d


def _no_autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, enabled=False) if dtype is not None else contextlib.nullcontext()


# The autograd functions below take the op's input and an ``anchor`` as tensors, the parameters inside ``info``:
# autograd never reaches a parameter through them (its hooks would fire with None in I), while the forward runs the
# op on the parameters themselves, grad off, so that it picks the kernels the plain forward picks. They return the
# input gradient and append a closure computing the weight gradients, with the formulas of autograd's own backward,
# to micro-batch m's list.


def _as(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gradient in the dtype of what it is the gradient of, as autograd's engine casts each node's outputs (an
    ambient autocast may have computed it in another: CUDA's sums in float32)."""
    return grad.to(like.dtype)


def _owned(y: torch.Tensor) -> torch.Tensor:
    """The output of an autograd function, copied where aten returned a view (a linear's on a 3-d input; a backend's
    conv1d or embedding may): autograd forbids changing a function's view in place (``nn.ReLU(inplace=True)``)."""
    return y if y._base is None else y.clone()


def _column_major(t: torch.Tensor) -> bool:
    """As autograd's mm backward tests a matrix, to return its gradient in the same layout."""
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


class _Linear(torch.autograd.Function):
    """F.linear, which aten runs as one mm (addmm) on the input's rows: the halves are mm's backward for each factor,
    in the layouts autograd's formulas choose (a column-major input gives a column-major gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None, info: Any) -> torch.Tensor:
        (weight, bias), _, dtype = info
        xc, wc, bc = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        with _no_autocast(x.device.type, dtype):
            y = F.linear(xc, wc, bc)
        y = _owned(y)
        ctx.save_for_backward(xc.detach(), wc.detach())
        # aten's linear adds the bias inside addmm for a 2-d or contiguous input, else after a matmul: its gradient
        # is then summed over every leading dimension of the output's, not over the rows of their matrix.
        ctx.bias_after = xc.dim() > 2 and not xc.is_contiguous()
        ctx.info, ctx.x_dtype = info, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        xc, wc = ctx.saved_tensors
        (weight, bias), sink, _ = ctx.info
        x2, g2, wt = xc.reshape(-1, xc.shape[-1]), g.reshape(-1, g.shape[-1]), wc.t()
        gx = None
        if ctx.needs_input_grad[0]:
            gx2 = wt.mm(g2.t()).t() if _column_major(x2) else g2.mm(wt.t())
            gx = _as(gx2.reshape(xc.shape), xc).to(ctx.x_dtype)
        bias_after = ctx.bias_after

        def closure() -> list[tuple[torch.Tensor, torch.Tensor]]:
            out = [(weight, _as(g2.t().mm(x2) if _column_major(wt) else x2.t().mm(g2).t(), wc))]
            if bias is not None:
                gb = (g if bias_after else g2).sum(list(range(g.dim() - 1 if bias_after else 1)))
                out.append((bias, _as(gb, wc)))  # under autocast the bias is cast as the weight is
            return out

        sink.append(_deferred(weight, bias, closure))
        return gx, None, None


@overload
def _detached(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...
@overload
def _detached(t: None, dtype: torch.dtype | None) -> None: ...
def _detached(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A parameter outside autograd, cast as autocast casts it (the cheap paths' weights and biases: a float64 one
    stays float64, as :func:`_cast` keeps it)."""
    return None if t is None else _cast(t.detach(), dtype)


def _on_node(y: torch.Tensor, keep: Callable[[tuple[torch.Tensor, ...]], None]) -> None:
    """``keep`` called with the output gradient of the op that produced ``y``, on that op's autograd node: a tensor
    hook is lost when the output is then changed in place, and where aten returns a view (a 3-d input's linear, a
    backend's conv1d) an in-place op on it reroutes the gradient around the view's node, into its base's."""
    node = (y if y._base is None else y._base).grad_fn
    assert node is not None, "the input requires grad, so does the op's output"
    node.register_prehook(keep)


def linear_weight_flops(x: torch.Tensor, weight: torch.Tensor) -> float:
    """The floating-point operations of a linear's weight gradient on input ``x``: 2 per weight element and input
    row."""
    return 2.0 * x.numel() / max(1, x.shape[-1]) * weight.numel()


def keep_linear_grads(
    y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    wc: torch.Tensor,
    sink: list[Deferred],
) -> None:
    """On the node of ``y`` = F.linear(``x``, ``wc``, bias) run with the weight outside autograd (``wc``: it as the op
    used it), a hook that keeps the output gradient and appends W's closure to ``sink``: the gradients of ``weight``
    and ``bias`` with the formulas of autograd's addmm backward (x: 2-d or contiguous, one addmm on its rows)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    wt = wc.t()

    def keep(grad_outputs: tuple[torch.Tensor, ...]) -> None:
        g2 = grad_outputs[0].reshape(-1, grad_outputs[0].shape[-1])

        def closure() -> list[tuple[torch.Tensor, torch.Tensor]]:
            out = [(weight, _as(g2.t().mm(x2) if _column_major(wt) else x2.t().mm(g2).t(), wc))]
            if bias is not None:
                out.append((bias, _as(g2.sum(0), wc)))
            return out

        sink.append(_deferred(weight, bias, closure))

    _on_node(y, keep)


def _linear_hooked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: list[Deferred], dtype: torch.dtype | None
) -> torch.Tensor:
    """F.linear with the parameters detached, so that autograd's own addmm backward computes the input gradient
    alone, in C++; a hook on the output keeps its gradient for W's closure (:func:`keep_linear_grads`). The cheap
    path, for an input that requires grad and is 2-d or contiguous (aten runs both as one addmm on its rows whether
    or not the weight requires grad); :class:`_Linear` takes the rest."""
    xc, wc, bc = _cast(x, dtype), _detached(weight, dtype), _detached(bias, dtype)  # x's cast differentiable
    with _no_autocast(x.device.type, dtype):
        y = F.linear(xc, wc, bc)
    keep_linear_grads(y, xc, weight, bias, wc, sink)
    return y


class _Conv(torch.autograd.Function):
    """F.conv1d, F.conv2d, F.conv3d: both halves from ``convolution_backward`` (autograd's formula), masked."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None, info: Any) -> torch.Tensor:
        (weight, bias), _, dtype, fn, geometry = info
        xc, wc, bc = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        with _no_autocast(x.device.type, dtype):
            y = _owned(fn(xc, wc, bc, *geometry))
        ctx.save_for_backward(xc.detach(), wc.detach())
        ctx.info, ctx.x_dtype = info, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        xc, wc = ctx.saved_tensors
        (weight, bias), sink, _, _, (stride, padding, dilation, groups) = ctx.info
        d = wc.dim() - 2
        geometry = (_as_list(stride, d), _as_list(padding, d), _as_list(dilation, d), False, [0] * d, int(groups))
        bias_sizes = None if bias is None else [wc.shape[0]]
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.convolution_backward(g, xc, wc, bias_sizes, *geometry, [True, False, False])[0]
            gx = _as(gx, xc).to(ctx.x_dtype)

        def closure() -> list[tuple[torch.Tensor, torch.Tensor]]:
            mask = [False, True, bias is not None]
            _, gw, gb = torch.ops.aten.convolution_backward(g, xc, wc, bias_sizes, *geometry, mask)
            return [(weight, _as(gw, wc))] + ([(bias, _as(gb, wc))] if bias is not None else [])

        sink.append(_deferred(weight, bias, closure))
        return gx, None, None


def _conv_hooked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sink: list[Deferred],
    dtype: torch.dtype | None,
    fn: Callable[..., torch.Tensor],
    geometry: tuple,
) -> torch.Tensor:
    """A convolution on an input that requires grad, as :func:`_linear_hooked`: run on detached parameters, so that
    autograd's own backward computes the input gradient alone (``convolution_backward`` masked as :class:`_Conv`'s
    I masks it), in C++; the output gradient kept for W's closure by a hook on the op's node."""
    xc, wc, bc = _cast(x, dtype), _detached(weight, dtype), _detached(bias, dtype)
    with _no_autocast(x.device.type, dtype):
        y = fn(xc, wc, bc, *geometry)
    x_kept, shape = xc.detach(), y.shape
    stride, padding, dilation, groups = geometry
    d = wc.dim() - 2
    full = (_as_list(stride, d), _as_list(padding, d), _as_list(dilation, d), False, [0] * d, int(groups))
    bias_sizes = None if bias is None else [wc.shape[0]]

    def keep(grad_outputs: tuple[torch.Tensor, ...]) -> None:
        g = grad_outputs[0].reshape(shape)  # the node may be that of a view's base (a backend's conv1d)

        def closure() -> list[tuple[torch.Tensor, torch.Tensor]]:
            mask = [False, True, bias is not None]
            _, gw, gb = torch.ops.aten.convolution_backward(g, x_kept, wc, bias_sizes, *full, mask)
            return [(weight, _as(gw, wc))] + ([(bias, _as(gb, wc))] if bias is not None else [])

        sink.append(_deferred(weight, bias, closure))

    _on_node(y, keep)
    return y


class _Embedding(torch.autograd.Function):
    """F.embedding (dense, no max_norm): its whole backward is the weight's, so all of it waits for W."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, anchor: torch.Tensor, info: Any) -> torch.Tensor:
        weight, _, padding_idx, scale = info
        ctx.save_for_backward(ids)
        ctx.info = info
        return _owned(torch.embedding(weight, ids, padding_idx, scale, False))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight, sink, padding_idx, scale = ctx.info

        def closure() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(weight, torch.ops.aten.embedding_backward(g, ids, weight.shape[0], padding_idx, scale, False))]

        sink.append(_deferred(weight, None, closure))
        return None, None, None


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list[Any]:
    """The values of ``names`` from a call's ``args`` and ``kwargs``; ``defaults`` for the last names."""
    values = [*args, *[*[None] * (len(names) - len(defaults)), *defaults][len(args) :]]
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values[: len(names)]


# Decides, per weight, whether its ops defer their weight gradients: (weight, W's operations per call,
# whether the op is a convolution) -> bool. The split ops call it before routing an op.
Decide = Callable[[torch.Tensor, float, bool], bool]


def _always(weight: torch.Tensor, flops: float, conv: bool) -> bool:
    return True


class Deferring(TorchFunctionMode):
    """Routes the ops this module splits, while grad is on and their weight is a trainable leaf that ``decide``
    defers; the rest as is. ``routed`` counts the ops routed."""

    def __init__(self, sink: list[Deferred], decide: Decide = _always) -> None:
        super().__init__()
        self.sink = sink
        self.decide = decide
        self.routed = 0
        self._anchors: dict[torch.device, torch.Tensor] = {}

    def _anchor(self, x: torch.Tensor, always: bool = False) -> torch.Tensor | None:
        """A leaf that makes the op's output require grad, as the weight would, where the input does not."""
        if x.requires_grad and not always:
            return None
        if x.device not in self._anchors:
            self._anchors[x.device] = torch.empty(0, device=x.device, requires_grad=True)
        return self._anchors[x.device]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            if func is F.linear:
                x, w, b = _bind(args, kwargs, ("input", "weight", "bias"), (None,))
                if (
                    trainable_leaf(w)
                    and (b is None or trainable_leaf(b))
                    and isinstance(x, torch.Tensor)
                    and x.dim() >= 2  # a vector input runs as a matrix-vector product
                    and saves_as_autograd()
                    and self.decide(w, linear_weight_flops(x, w), False)
                ):
                    self.routed += 1
                    dtype = autocast_dtype(x.device.type)
                    if x.requires_grad and (x.dim() == 2 or x.is_contiguous()):
                        return _linear_hooked(x, w, b, self.sink, dtype)
                    return _Linear.apply(x, self._anchor(x), ((w, b), self.sink, dtype))
            elif func in _CONVS:
                names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
                x, w, b, *geometry = _bind(args, kwargs, names, (None, 1, 0, 1, 1))
                if (
                    trainable_leaf(w)
                    and (b is None or trainable_leaf(b))
                    and isinstance(x, torch.Tensor)
                    and x.dim() == w.dim()  # batched input (convolution_backward's shapes)
                    and not isinstance(geometry[1], str)  # padding="same" pads unevenly outside convolution
                    and saves_as_autograd()
                    and self.decide(w, _conv_weight_flops(x, w, geometry[0]), True)
                ):
                    self.routed += 1
                    dtype = autocast_dtype(x.device.type)
                    if x.requires_grad:
                        return _conv_hooked(x, w, b, self.sink, dtype, func, tuple(geometry))
                    conv = ((w, b), self.sink, dtype, func, tuple(geometry))
                    return _Conv.apply(x, self._anchor(x), conv)
            elif func is F.embedding:
                names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
                ids, w, padding_idx, max_norm, _, scale, sparse = _bind(
                    args, kwargs, names, (None, None, 2.0, False, False)
                )
                if (
                    trainable_leaf(w)
                    and max_norm is None
                    and not sparse
                    and isinstance(ids, torch.Tensor)
                    and (padding_idx is None or -w.shape[0] <= padding_idx < w.shape[0])  # else F.embedding raises
                    and saves_as_autograd()
                    and self.decide(w, float(ids.numel() * w.shape[-1]), False)
                ):
                    self.routed += 1
                    if padding_idx is None:
                        padding_idx = -1
                    elif padding_idx < 0:
                        padding_idx += w.shape[0]  # as F.embedding normalizes it
                    embedding = (w, self.sink, padding_idx, bool(scale))
                    return _Embedding.apply(ids, self._anchor(w, always=True), embedding)
        return func(*args, **kwargs)


def _conv_weight_flops(x: torch.Tensor, w: torch.Tensor, stride: Any) -> float:
    """About the floating-point operations of a convolution's weight gradient: 2 per weight element and output
    position."""
    positions = math.prod(x.shape[2:]) / max(1, math.prod(_as_list(stride, w.dim() - 2)))  # shapes only: no op
    return 2.0 * x.shape[0] * positions * w.numel()
