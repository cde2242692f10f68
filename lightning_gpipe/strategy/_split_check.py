"""The split-invariance check: ``pipeline_loss`` gives the same loss and logs on micro-batches joined or split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_gpipe.pipe.microbatch import batch_size, join, split_by_sizes
from lightning_gpipe.strategy._micro_batch_logs import LogRecorder, step_only_metrics

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
    real_log, real_log_dict = module.log, module.log_dict
    module.log, module.log_dict = recorder.log, recorder.log_dict
    try:
        for out, (a, k), w in zip(outputs, pieces, weights):
            recorder.weight = w / total if total else 0.0
            value = float(hook(out, *a, **k))
            if recorder.weight:
                loss += recorder.weight * value
    finally:
        module.log, module.log_dict = real_log, real_log_dict
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
