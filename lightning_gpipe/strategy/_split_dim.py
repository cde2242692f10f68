"""Is the backbone's input split along the samples? Its first training call compared with the loader's batch."""

from __future__ import annotations

from typing import Any

import torch

from lightning_gpipe.pipe.microbatch import batch_size, tensors


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _elsewhere(input: Any, batch: Any, split: int, batch_dim: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(dim, input tensor, loader tensor): a loader tensor disagrees with the split size, the backbone's input holds
    that tensor's dim-0 size along another dimension, and a loader tensor holds both sizes: the samples are there,
    not along ``batch_dim``."""
    loaded = [t for t in tensors(batch) if t.dim() > 0]
    # A loader tensor agrees when it holds the split size along dim 0 (batch-first) or batch_dim (as the input).
    # One that does not is either per-sample along dim 0 (labels (N,) beside time-major tokens (T, N)), or a
    # per-batch constant (a vocabulary mask (V,)); the input and the loader both showing the two sizes side by side
    # (time-major tokens (T, N) and hidden states (T, N, D)) separate the two, where a size that merely equals a
    # width (rows of flattened tokens (N·T, D) with D = N) does not.
    disagree = [t for t in loaded if t.shape[0] != split and not (t.dim() > batch_dim and t.shape[batch_dim] == split)]
    for x in tensors(input):
        for j, size in enumerate(x.shape):
            if j == batch_dim:
                continue
            for t in disagree:
                if t.shape[0] == size and any(split in u.shape and size in u.shape for u in loaded):
                    return j, x, t
    return None


def check_split_dim(input: Any, batch: Any, batch_dim: int, path: str) -> str | None:
    """Raise ValueError where splitting ``input`` (the backbone's, at its first training call) along ``batch_dim``
    cuts across another dimension than the loader's ``batch`` has its samples in; return a warning where the split
    size is no size of the batch and nothing tells where its samples went (rows of flattened tokens: maybe meant).
    """
    if not any(t.dim() > 0 for t in tensors(input)):
        return None  # a later stage's input is not used; stage 0's engine names an input without tensors
    try:
        split = batch_size(input, batch_dim)
    except ValueError as e:  # a backbone input of disagreeing tensors: every rank stops here, before the pipeline
        raise ValueError(f"GPipeStrategy: self.{path}'s input cannot be split into micro-batches: {e}") from None
    found = _elsewhere(input, batch, split, batch_dim)
    if found is not None:
        j, x, t = found
        raise ValueError(
            f"GPipeStrategy: self.{path}'s input, of shape {_shape(x)}, is split into micro-batches along dim "
            f"{batch_dim} (batch_dim={batch_dim}), of size {split}, but the loader's batch holds {t.shape[0]} samples "
            f"(a tensor of shape {_shape(t)}), which the input holds along dim {j}: split along dim {batch_dim}, "
            f"each micro-batch would mix every sample and train another model than one device does. Set "
            f"GPipeStrategy(batch_dim={j}) if dim {j} holds the samples in the backbone (time-major (T, N, ...) "
            "layers and data, such as pad_sequence's default), or give the backbone batch-first input "
            "(pad_sequence(..., batch_first=True)). A tensor that is the same for every sample (a mask over the "
            "vocabulary) belongs in the module (a buffer), not in the batch"
        )
    sizes = sorted({t.shape[0] for t in tensors(batch) if t.dim() > 0})
    if not sizes or split in sizes:
        return None
    return (
        f"GPipeStrategy: self.{path}'s input was split into micro-batches along dim {batch_dim}, of size {split}, "
        f"but the loader's batch holds {sizes} samples (dim 0 of its tensors). If the rows along dim {batch_dim} "
        "are independent (tokens flattened into rows), this is the same run; if another dimension holds the samples, "
        "set GPipeStrategy(batch_dim=...) to it, or each micro-batch mixes samples and trains another model."
    )
