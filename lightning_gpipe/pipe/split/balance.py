"""Partitioning: split the L layers of an nn.Sequential into K contiguous stages, by layer counts or per-layer cost."""

from __future__ import annotations

import contextlib
import math
import numbers
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_gpipe.pipe import skips
from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_map
from lightning_gpipe.pipe.microbatch import detached
from lightning_gpipe.pipe.state.rng import cuda_devices_of

Balance = Union[Sequence[int], Literal["parameters", "time", "flops"], Callable[[int, nn.Module], float]]  # noqa: UP007
Solver = Callable[[Sequence[float], int], list[int]]  # per-layer costs, the number of stages → layer counts

_ACCEPTED = "a sequence of K layer counts, 'parameters', 'time', 'flops', or a callable (index, layer) -> cost"


def solve(costs: Sequence[float], K: int, last_stage_scale: float = 1.0) -> list[int]:
    """Exact contiguous split of L=len(costs) layers into K non-empty stages minimising the costliest stage.

    Returns the layer counts per stage. Among optimal splits the last stage is as short as possible, then the one
    before it, and so on (earlier stages take the surplus): the last stage also runs the loss outside the backbone.
    ``last_stage_scale`` weighs the last stage's layers (its work per unit of cost differs: with the loss inside
    the pipeline the last stage never recomputes, the others do).
    """
    if isinstance(K, bool) or not isinstance(K, int):
        raise TypeError(f"K must be an int number of stages, got {K!r} ({type(K).__name__})")
    L = len(costs)
    if K < 1:
        raise ValueError(f"cannot split {L} layers into {K} stages: K must be ≥ 1")
    if K > L:
        raise ValueError(f"cannot split {L} layers into {K} stages: K must be ≤ L")
    c = [float(x) for x in costs]
    for i, x in enumerate(c):
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"cost of layer {i} is {x}; costs must be finite and ≥ 0")

    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)

    # best[k][j]: the smallest possible costliest stage when the first j layers form k stages.
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(K + 1)]
    best[0][0] = 0.0
    if not (math.isfinite(last_stage_scale) and last_stage_scale > 0):
        raise ValueError(f"last_stage_scale must be finite and > 0, got {last_stage_scale}")

    def cost(k: int, i: int, j: int) -> float:  # stage k (1-based) holding layers i … j−1
        return (prefix[j] - prefix[i]) * (last_stage_scale if k == K else 1.0)

    for k in range(1, K + 1):
        # Stages after k need at least one layer each, so j never exceeds L - (K - k).
        for j in range(k, L - (K - k) + 1):
            prev = best[k - 1]
            best[k][j] = min(max(prev[i], cost(k, i, j)) for i in range(k - 1, j))

    # Reconstruct against the global optimum rather than each prefix's own optimum, so the tie-break above holds
    # over all optimal splits; the comparisons reuse the same float sums, so they are exact.
    bound = best[K][L]
    counts: list[int] = []
    j = L
    for k in range(K, 0, -1):
        i = next(i for i in range(j - 1, k - 2, -1) if best[k - 1][i] <= bound and cost(k, i, j) <= bound)
        counts.append(j - i)
        j = i
    counts.reverse()
    return counts


def validate_balance(balance: Sequence[int], L: int, K: int) -> list[int]:
    """Checks an explicit balance (K positive int layer counts adding up to L) and returns it as a list."""
    entries = list(balance)
    if len(entries) != K:
        raise ValueError(
            f"balance {entries} has {len(entries)} entries but there are {K} stages; give one layer count per stage"
        )
    for k, n in enumerate(entries):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"balance[{k}] is {n!r} ({type(n).__name__}); layer counts must be positive ints")
        if n <= 0:
            raise ValueError(f"balance[{k}] is {n}; every stage needs at least one layer, so give a count ≥ 1")
    total = sum(int(n) for n in entries)
    if total != L:
        raise ValueError(
            f"balance {entries} sums to {total} but the backbone has {L} layers; give layer counts that add up to {L}"
        )
    return [int(n) for n in entries]


def costs_by_parameters(module: nn.Sequential) -> list[float]:
    """c_i = parameter elements of layer i; a parameter shared between layers is counted once, at its first use."""
    seen: set[int] = set()
    costs: list[float] = []
    for i, layer in enumerate(module):
        total = 0
        for p in layer.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if nn.parameter.is_lazy(p):
                raise ValueError(
                    f"layer {i} ({type(layer).__name__}) has uninitialized lazy parameters; run a forward pass first "
                    "or use balance='time' or 'flops'"
                )
            total += p.numel()
        costs.append(float(total))
    return costs


def costs_by_function(module: nn.Sequential, fn: Callable[[int, nn.Module], float]) -> list[float]:
    """c_i = fn(i, layer_i), the paper's user-given cost estimate."""
    return [float(fn(i, layer)) for i, layer in enumerate(module)]


def _as_input(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()
    if x.is_floating_point():
        x.requires_grad_(True)
    # A copy, so that in-place layers (ReLU(inplace=True)) neither fail on a leaf nor overwrite the next run's input.
    return x.clone()


def _home(layer: nn.Module) -> torch.device | None:
    first = next(iter([*layer.parameters(), *layer.buffers()]), None)
    return None if first is None else first.device


def costs_by_time(
    module: nn.Sequential, sample: Any, *, repeat: int = 3, warmup: int = 1, device: torch.device | None = None
) -> list[float]:
    """c_i = median seconds of layer i's forward + backward on `sample`, fed through the preceding layers.

    The layers are timed in sweeps, each running every layer once in order (``warmup`` sweeps first, untimed), and
    each layer's cost is its median over the ``repeat`` timed sweeps: a slow spell of the machine then falls on one
    sweep of every layer, not on every run of a few layers, which would tilt the cut towards them.
    With ``device``, each layer is moved there for its timing and back afterwards, so a model too large for one
    device can still be profiled on it. Leaves the module as it found it: buffers (BatchNorm statistics), .grad,
    devices and the RNG streams are restored.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be ≥ 1 and warmup ≥ 0, got repeat={repeat}, warmup={warmup}")
    if device is not None:
        device = torch.device(device)
        sample = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, sample)
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)]
    cuda = cuda_devices_of(*tensors)
    if device is not None and device.type == "cuda":
        cuda = sorted({*cuda, device.index if device.index is not None else torch.cuda.current_device()})

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    params = list(module.parameters())
    grads = [p.grad for p in params]
    times: list[list[float]] = [[] for _ in module]
    layer, home = None, None
    try:
        # Profiling must not shift the caller's random streams (dropout), or a 'time' run would train differently.
        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), skips.profiling(_as_input):
            for p in params:
                p.grad = None
            for sweep in range(warmup + repeat):
                x = sample
                for i, layer in enumerate(module):
                    home = _home(layer)
                    if device is not None and home is not None:
                        layer.to(device)
                    inputs = tree_map(_as_input, x)
                    sync()
                    start = time.perf_counter()
                    out = layer(inputs)
                    flat = tree_flatten(out)[0]
                    grad_outs = [
                        t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
                    ]
                    if grad_outs:
                        # One scalar per output rather than a single sum: outputs may differ in device and dtype.
                        torch.autograd.backward([t.sum() for t in grad_outs])
                    sync()
                    if sweep >= warmup:
                        times[i].append(time.perf_counter() - start)
                    x = detached(out)
                    # The gradients are a by-product; dropping them keeps peak memory at one layer's worth.
                    for p in layer.parameters():
                        p.grad = None
                    if device is not None and home is not None:
                        layer.to(home)
                    layer = None
    finally:
        if layer is not None and device is not None and home is not None:
            layer.to(home)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return [statistics.median(t) for t in times]


def costs_by_flops(module: nn.Sequential, sample: Any) -> list[float]:
    """c_i = layer i's forward FLOPs on ``sample`` fed through the preceding layers, plus the elements it outputs.

    Counted by torch's ``FlopCounterMode`` (matmuls, convolutions, attention), so deterministic and independent of
    the machine; only shapes matter, so a model on the meta device is counted without computing anything. Leaves
    the module as it found it (buffers, RNG streams); backward is not run.
    """
    tensors = [*module.parameters(), *module.buffers()]
    cuda = cuda_devices_of(*tensors)
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    costs: list[float] = []
    try:
        # Dropout must not shift the caller's random streams; BatchNorm's running statistics are put back below.
        # With grad, as in training (a layer may branch on it); each layer's graph is dropped after it.
        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), skips.profiling(_as_input):
            x = sample
            for i, layer in enumerate(module):
                counter = FlopCounterMode(display=False)
                inputs = tree_map(_as_input, x)
                try:
                    with counter:
                        x = detached(layer(inputs))
                except Exception as e:
                    where = "on the meta device " if any(t.is_meta for t in tensors) else ""
                    raise RuntimeError(
                        f"balance='flops': layer {i} ({type(layer).__name__}) failed {where}while its FLOPs were "
                        f"counted, with {type(e).__name__}: {e}; use balance='parameters', 'time' or layer counts"
                    ) from e
                # The elements it outputs: a layer without matmuls (an activation, a reshape) still costs time,
                # roughly in proportion to what it writes, and a zero cost would let the solver put any number of
                # them on any stage. Next to a matmul's FLOPs the term is negligible.
                elements = sum(t.numel() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))
                costs.append(float(counter.get_total_flops() + elements))
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    return costs


def resolve_balance(
    module: nn.Sequential, K: int, balance: Balance, *, sample: Any = None, solver: Solver = solve
) -> list[int]:
    """Turns any Balance into K layer counts, those from costs by ``solver(costs, K)``. Local only: the caller
    broadcasts the result so every rank agrees."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"the backbone to partition must be an nn.Sequential, got {type(module).__name__}")
    L = len(module)
    if isinstance(balance, str):
        if balance == "parameters":
            return solver(costs_by_parameters(module), K)
        if balance == "time":
            if sample is None:
                raise ValueError("balance='time' profiles each layer on a sample micro-batch; pass sample=...")
            return solver(costs_by_time(module, sample), K)
        if balance == "flops":
            if sample is None:
                raise ValueError("balance='flops' counts each layer's FLOPs on a sample micro-batch; pass sample=...")
            return solver(costs_by_flops(module, sample), K)
        raise ValueError(f"unknown balance {balance!r}; accepted values: {_ACCEPTED}")
    if callable(balance):
        return solver(costs_by_function(module, balance), K)
    if isinstance(balance, Sequence) and not isinstance(balance, str):  # str was handled above; this tells mypy
        return validate_balance(balance, L, K)
    raise TypeError(f"balance must be {_ACCEPTED}; got {type(balance).__name__}")


def stage_layers(module: nn.Sequential, balance: Sequence[int], k: int) -> list[tuple[str, nn.Module]]:
    """The (child name, layer) pairs stage k owns, in order; original names keep state-dict keys global."""
    counts = validate_balance(balance, len(module), len(balance))
    if not 0 <= k < len(counts):
        raise IndexError(f"stage {k} does not exist: there are {len(counts)} stages, numbered 0 to {len(counts) - 1}")
    start = sum(counts[:k])
    return list(module._modules.items())[start : start + counts[k]]


def shared_parameters(module: nn.Sequential, balance: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters used by the layers of more than one stage (tied weights), as (name, stages holding it).

    The name is the parameter's first name in ``module`` (e.g. ``"0.embed.weight"``); the list is in ``module``'s
    order, so every rank computes the same one.
    """
    counts = validate_balance(balance, len(module), len(balance))
    holders: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    start = 0
    layers = list(module._modules.items())
    for k, count in enumerate(counts):
        for layer_name, layer in layers[start : start + count]:
            assert layer is not None
            for name, p in layer.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), f"{layer_name}.{name}")
                if k not in holders.setdefault(id(p), []):
                    holders[id(p)].append(k)
        start += count
    return [(names[i], tuple(stages)) for i, stages in holders.items() if len(stages) > 1]


def local_name(layers: list[tuple[str, nn.Module]], param: nn.Parameter) -> str:
    """The name of ``param`` among the (name, layer) pairs of one stage, e.g. ``"3.weight"``."""
    return next(
        f"{layer_name}.{name}"
        for layer_name, layer in layers
        for name, p in layer.named_parameters(remove_duplicate=False)
        if p is param
    )


def agree_on_balance(
    module: nn.Sequential, K: int, balance: Balance, *, sample: Any = None, group: Any = None, solver: Solver = solve
) -> list[int]:
    """:func:`resolve_balance` on group rank 0, broadcast to the others (a collective when ``group`` is given).

    Resolved once, so that profiled timings, which differ per process, cannot give two stages different splits;
    an invalid balance raises the same error on every rank, and so does any error of a cost callable or profile.
    """
    result: list[Any] = [None, None]
    error: BaseException | None = None
    if group is None or dist.get_rank(group) == 0:
        try:
            result[0] = resolve_balance(module, K, balance, sample=sample, solver=solver)
        except Exception as e:
            error = e
            result[1] = _portable(e, balance)
    if group is not None and K > 1:
        dist.broadcast_object_list(result, group=group, group_src=0)
    if result[1] is not None:
        raised = result[1] if isinstance(result[1], BaseException) else RuntimeError(result[1])
        if raised is error:
            raise raised
        raise raised from error
    return result[0]


def _portable(e: Exception, balance: Balance) -> Exception | str:
    """What reaches the other ranks: the error itself when it is a ValueError/TypeError about the arguments and
    survives pickling; otherwise its text, naming where it came from (an error the other ranks could not unpickle
    would fail the broadcast itself with a raw gloo error)."""
    if type(e) in (ValueError, TypeError):
        with contextlib.suppress(Exception):
            if type(pickle.loads(pickle.dumps(e))) is type(e):
                return e
    source = (
        f"the balance cost function {getattr(balance, '__qualname__', repr(balance))}"
        if callable(balance) and not isinstance(balance, str)
        else f"resolving balance={balance!r}"
    )
    return f"{source} failed on stage 0 with {type(e).__name__}: {e}; fix it, or pass balance as K layer counts"
