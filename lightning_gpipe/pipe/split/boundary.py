"""What may cross a stage boundary: every tensor carries the micro-batch's samples along the batch dimension."""

from __future__ import annotations

from typing import Any

import torch

from lightning_gpipe.pipe._torch_internals import keystr, tree_flatten, tree_flatten_with_path
from lightning_gpipe.pipe.microbatch import is_per_sample_sequence

_FIX = (
    "pass batch_dim=1 (GPipeStrategy(batch_dim=1)) for time-major (T, N, …) tensors, or return batch-first tensors; "
    "every tensor that crosses a stage boundary must carry the batch dimension"
)


def check_boundary(output: Any, n: int, batch_dim: int, producer: str, last: bool) -> None:
    """Raise ValueError unless every tensor of a stage's micro-batch ``output`` has ``n`` samples along
    ``batch_dim``; ``producer`` names the layer that returned it. The last stage's output is the pipeline's: it is
    joined along the batch dimension, so it must hold something per-sample and no 0-dim tensor."""
    # A tensor of another length is wrong in any case: split along time, the next stage's micro-batch would mix
    # samples, and the joined output would be concatenated along the wrong dimension -- silently wrong numbers.
    for path, leaf in tree_flatten_with_path(output)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        if leaf.dim() <= batch_dim or leaf.shape[batch_dim] != n:
            size = "has no such dimension" if leaf.dim() <= batch_dim else f"is {leaf.shape[batch_dim]}"
            raise ValueError(
                f"{producer} returned a tensor of shape {tuple(leaf.shape)} at output{keystr(path)}, whose batch "
                f"dimension (batch_dim={batch_dim}) {size}, but this micro-batch has {n} samples: {_FIX}"
            )
    if last:
        _check_final(output, n, batch_dim, producer)


def _check_final(output: Any, n: int, batch_dim: int, producer: str) -> None:
    leaves = tree_flatten(output)[0]
    zero_dim = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() == 0]
    # Per-sample strings or ids alone are a valid output too: they are joined like a tensor (see microbatch).
    per_sample = any(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 for leaf in leaves)
    per_sample = per_sample or is_per_sample_sequence(output, n)
    if not zero_dim and per_sample:
        return
    if output is None:
        what = "None"
    elif zero_dim:
        what = f"a 0-dim tensor ({len(zero_dim)} of them)" if len(zero_dim) > 1 else "a 0-dim tensor"
    else:
        what = f"nothing per-sample ({type(output).__name__})"
    raise ValueError(
        f"{producer}, the last layer of the pipelined module, returned {what}: the pipelined module must return "
        f"per-sample tensors (the samples along dim {batch_dim}), which the pipeline joins over the micro-batches. "
        "Compute a scalar (e.g. the loss) after the backbone, in the training step, not inside it"
    )
