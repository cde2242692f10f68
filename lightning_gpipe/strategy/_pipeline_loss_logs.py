"""Logs and metrics in a pipeline: ``pipeline_loss``'s per micro-batch, combined and checked; metrics' sync groups."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.microbatch import batch_size, join, split_by_sizes
from lightning_gpipe.strategy._lightning_internals import (
    local_compute,
    set_forward_cache,
    set_update_count,
    update_count,
)

REDUCTIONS = ("mean", "sum", "max", "min")


def host_floats(values: list[Any]) -> list[float]:
    """``values`` (numbers, or one-element tensors on any device) as floats, with one device-to-host copy for all
    the tensors of a device: per step, not per micro-batch, so the host does not wait for the GPU M times."""
    out = [v if isinstance(v, (int, float)) else None for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if out[i] is None:
            by_device.setdefault(torch.as_tensor(v).device, []).append(i)
    for device, indices in by_device.items():
        stacked = torch.stack([torch.as_tensor(values[i], device=device).detach().reshape(()) for i in indices])
        for i, x in zip(indices, stacked.double().tolist()):
            out[i] = x
    return [float(x) for x in out]  # type: ignore[arg-type]


@dataclass
class _Key:
    kwargs: dict[str, Any]
    values: list[Any] = field(default_factory=list)  # as logged (tensors stay on their device until combined)
    weights: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    metric: str | None = None  # the logged Metric's module path
    dtype: torch.dtype | None = None  # of the logged tensors; None for numbers, which Lightning converts itself


def _reduction(name: str, kwargs: dict[str, Any]) -> str:
    fx = kwargs.get("reduce_fx", "mean")
    for candidate in REDUCTIONS:
        if fx == candidate or fx is getattr(torch, candidate):
            return candidate
    raise ValueError(
        f"self.log({name!r}, ..., reduce_fx={fx!r}) inside pipeline_loss: GPipeStrategy combines the micro-batches' "
        f"values with one of {list(REDUCTIONS)}; log it in training_step instead, or pipeline_loss=False"
    )


class LogRecorder:
    """Takes the place of ``self.log`` inside ``pipeline_loss`` on the last stage: one call per micro-batch and key,
    combined by the key's ``reduce_fx`` -- a mean weighted by ``batch_size`` where given, else by the micro-batch's
    weight in the loss, which gives the whole batch's mean over samples (or over ``pipeline_loss_denominator``)."""

    def __init__(self, module: nn.Module) -> None:
        self.keys: dict[str, _Key] = {}
        self.weight = 1.0
        self._module = module
        self._metric_paths = {id(m): name for name, m in module.named_modules()}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The module's ``self.log`` and ``self.log_dict`` are this recorder's while the block runs."""
        module: Any = self._module
        real_log, real_log_dict = module.log, module.log_dict
        module.log, module.log_dict = self.log, self.log_dict
        try:
            yield
        finally:
            module.log, module.log_dict = real_log, real_log_dict

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"self.log({name!r}, ...) inside pipeline_loss: pass its options by keyword")
        key = self.keys.setdefault(name, _Key(dict(kwargs)))
        rest = {k: v for k, v in kwargs.items() if k != "batch_size"}
        if rest != {k: v for k, v in key.kwargs.items() if k != "batch_size"}:
            raise ValueError(f"self.log({name!r}, ...) inside pipeline_loss was called with other options this time")
        if hasattr(value, "compute") and id(value) in self._metric_paths:  # a torchmetrics Metric of the module
            key.metric = self._metric_paths[id(value)]
            return
        _reduction(name, kwargs)
        key.values.append(value.detach() if isinstance(value, torch.Tensor) else float(value))
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            key.dtype = value.dtype
        key.weights.append(self.weight)
        if "batch_size" in kwargs:
            key.batch_sizes.append(int(kwargs["batch_size"]))

    def log_dict(self, dictionary: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def combined(self, M: int) -> list[tuple[str, Any, dict[str, Any]]]:
        """(name, value or Metric path, options) per key, in the order first logged, the values combined as floats."""
        out: list[tuple[str, Any, dict[str, Any]]] = []
        logged = [key for key in self.keys.values() if key.metric is None]
        flat = host_floats([v for key in logged for v in key.values])
        for key in logged:
            key.values, flat = flat[: len(key.values)], flat[len(key.values) :]
        for name, key in self.keys.items():
            if key.metric is not None:
                out.append((name, key.metric, key.kwargs))
                continue
            if len(key.values) != M:
                raise ValueError(
                    f"self.log({name!r}, ...) inside pipeline_loss ran for {len(key.values)} of the {M} micro-batches: "
                    "log the same keys for every micro-batch (its value would otherwise miss part of the batch)"
                )
            fx, v, kwargs = _reduction(name, key.kwargs), key.values, dict(key.kwargs)
            if fx == "sum":
                value = math.fsum(v)
            elif fx in ("max", "min"):
                value = max(v) if fx == "max" else min(v)
            elif key.batch_sizes:
                kwargs["batch_size"] = sum(key.batch_sizes)
                value = math.fsum(b * x for b, x in zip(key.batch_sizes, v)) / max(kwargs["batch_size"], 1)
            else:
                value = math.fsum(w * x for w, x in zip(key.weights, v))
            out.append((name, value, kwargs))
        return out

    def logs(self, M: int) -> list[tuple[str, Any, dict[str, Any]]]:
        """What every rank logs once: :meth:`combined`, each value a CPU tensor in the dtype it was logged in (the
        plain run's: float64 under "64-true"), or a float where numbers were (which Lightning converts as it would)."""
        out = []
        for name, value, kwargs in self.combined(M):
            dtype = self.keys[name].dtype  # None for a Metric
            out.append((name, value if dtype is None else torch.tensor(value, dtype=dtype), kwargs))
        return out


def _metrics(module: nn.Module) -> Iterator[tuple[str, Any]]:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return
    for name, m in module.named_modules():
        if isinstance(m, Metric):
            yield name, m


@contextmanager
def step_only_metrics(module: nn.Module, out: dict[str, Any]) -> Iterator[None]:
    """On the last stage, while the micro-batches run: every metric starts empty, so that what it holds after them
    is this step's increment (``out[path] = (state, step value, updates)``); its earlier state is merged back after."""
    saved = {}
    for name, metric in _metrics(module):
        saved[name] = (metric.metric_state, update_count(metric))
        metric.reset()
    try:
        yield
    finally:
        for name, metric in _metrics(module):
            before, count = saved[name]
            if update_count(metric) and name not in out:
                out[name] = (_cpu(metric.metric_state), _cpu(local_compute(metric)), update_count(metric))
            for attr, value in before.items():  # as it was; absorb() then adds the increment, alike on every rank
                setattr(metric, attr, value)
            set_update_count(metric, count)


def absorb(module: nn.Module, increments: dict[str, Any], device: torch.device) -> None:
    """Add each metric's step increment to its state, as on the last stage, and set its step value."""
    metrics = dict(_metrics(module))
    for name, (state, value, updates) in increments.items():
        metric = metrics[name]
        before, count = metric.metric_state, update_count(metric)
        for attr, v in state.items():
            setattr(metric, attr, _on(v, device))
        set_update_count(metric, count + updates)
        if count:
            try:
                metric.merge_state(before)
            except RuntimeError as e:
                raise RuntimeError(
                    f"GPipeStrategy: the metric {name} ({type(metric).__name__}) was updated inside pipeline_loss, "
                    f"per micro-batch, and cannot add its steps' states together ({e}); update it in training_step, "
                    "or pipeline_loss=False"
                ) from e
        set_forward_cache(metric, _on(value, device))


def replay(module: Any, logs: list[tuple[str, Any, dict[str, Any]]], device: torch.device) -> None:
    """The real ``self.log`` calls, once per key, with the combined values: the same on every rank."""
    modules = dict(module.named_modules())
    for name, value, kwargs in logs:
        if isinstance(value, str):
            module.log(name, modules[value], **kwargs)
        else:
            module.log(name, value.to(device) if isinstance(value, torch.Tensor) else value, **kwargs)


def _cpu(tree: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def _on(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


# The split-invariance check: ``pipeline_loss`` gives the same loss and logs on micro-batches joined or split.


Hook = Callable[..., Tensor]
Count = Callable[..., Any] | None
Pieces = list[tuple[tuple, dict]]


def _values(module: Any, hook: Hook, count: Count, outputs: list[Any], pieces: Pieces, batch_dim: int) -> dict:
    """The loss and every logged number of ``pieces`` (with their outputs), combined with the path's weights."""
    if count is not None:
        weights = [float(count(*a, **k)) for a, k in pieces]
    else:
        weights = [float(batch_size(o, batch_dim)) for o in outputs]
    total = sum(weights)
    recorder, loss = LogRecorder(module), 0.0
    with recorder.recording():
        for out, (a, k), w in zip(outputs, pieces, weights):
            recorder.weight = w / total if total else 0.0
            value = float(hook(out, *a, **k))
            if recorder.weight:
                loss += recorder.weight * value
    logged = {f"the logged {name!r}": v for name, v, _ in recorder.combined(len(pieces)) if isinstance(v, float)}
    return {"the loss": loss, **logged}


def _first(pieces: list[Any], sizes: list[int], N: int) -> list[Any]:
    return pieces[: len(sizes)] if sum(sizes) < N else pieces


def check_split_invariance(
    module: Any,
    hook: Hook,
    count: Count,
    kept: list[Any],
    arguments: tuple[tuple, dict],
    N: int,
    batch_dim: int,
    precise: bool,
) -> None:
    """Re-run ``hook`` without grad on the outputs ``kept`` of micro-batches 0 and 1 (the first n samples of the
    batch, whose ``arguments`` are the hook's for all N): on the n joined, as the pipeline split them, and split
    1 | n−1. The path is exact only if they agree (``docs/design/micro-batch-loss.md`` §3). Metrics, logs and the
    RNG are left as they were; raises, naming the value that differs, when they do not agree.
    """
    sizes = [batch_size(o, batch_dim) for o in kept]
    n = sum(sizes)
    joined_out = join(kept, batch_dim, sizes)
    cut = [n, N - n] if N > n else [n]
    splits = [(kept, _first(split_by_sizes(arguments, [*sizes, *cut[1:]], batch_dim), sizes, N))]
    if n >= 2 and sizes != [1, n - 1]:
        uneven = [1, n - 1]
        parts = _first(split_by_sizes(arguments, [*uneven, *cut[1:]], batch_dim), uneven, N)
        splits.append((split_by_sizes(joined_out, uneven, batch_dim), parts))
    joined_args = split_by_sizes(arguments, cut, batch_dim)[0]
    tol = 1e-5 if precise else 2e-2
    with torch.no_grad(), torch.random.fork_rng(devices=[]), step_only_metrics(module, {}):
        whole = _values(module, hook, count, [joined_out], [joined_args], batch_dim)
        for outs, parts in splits:
            split = _values(module, hook, count, outs, parts, batch_dim)
            for key, value in whole.items():
                other = split.get(key)
                if other is None or abs(other - value) > tol * max(1.0, abs(value)):
                    shown = [batch_size(o, batch_dim) for o in outs]
                    raise ValueError(
                        f"GPipeStrategy(pipeline_loss=...): pipeline_loss does not add up over micro-batches: {key} is "
                        f"{value:.6g} on {n} samples at once but {other:.6g} on the same samples split {shown} and "
                        "weighted by their share of the batch. It must be a mean over samples; for a mean over "
                        "something else (tokens that are not padding), define pipeline_loss_denominator(batch) "
                        "returning that count; a loss that compares samples within the batch (contrastive, ranking, "
                        "batch statistics after the backbone) belongs in training_step with GPipeStrategy("
                        "pipeline_loss=False)"
                    )


# torchmetrics under a pipeline: metric states are synchronized over the data-parallel replicas, not the stages.


def sync_metrics_over(module: nn.Module, group: Any) -> int:
    """Point every torchmetrics ``Metric`` of ``module`` that syncs over the whole world at ``group``; returns how many.

    Every stage of a pipeline holds the same metric states (the same output reaches each, or with
    ``output="placeholder"`` they are copied from the last stage), so a sync over the world would count each sample K
    times. A metric given its own ``process_group`` keeps it, unless that group is the world.
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return 0
    changed = 0
    for m in module.modules():
        if not isinstance(m, Metric):
            continue
        if (m.process_group is None or m.process_group is dist.group.WORLD) and m.process_group is not group:
            m.process_group = group
            changed += 1
    return changed
