"""Split nested batches into M micro-batches along dim 0 and join them back; non-tensors are replicated."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _is_batched(leaf: Any) -> bool:
    # 0-dim tensors have no batch dimension: they are replicated like any other non-tensor value.
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def batch_size(batch: Any) -> int:
    """N, the common dim-0 size of every batched tensor in ``batch``; errors if they disagree or there are none."""
    leaves, _ = tree_flatten(batch)
    sizes = {tuple(leaf.shape)[0] for leaf in leaves if _is_batched(leaf)}
    if not sizes:
        raise ValueError(
            "the batch holds no tensor with a batch dimension to split into micro-batches; "
            "pass at least one tensor whose dim 0 is the batch"
        )
    if len(sizes) > 1:
        shapes = [tuple(leaf.shape) for leaf in leaves if _is_batched(leaf)]
        raise ValueError(
            f"tensors in the batch disagree on the batch size (dim 0): shapes {shapes}; "
            "every tensor that is split into micro-batches needs the same dim-0 size"
        )
    return sizes.pop()


def micro_batch_sizes(N: int, chunks: int) -> list[int]:
    """Sizes of the M = min(chunks, N) micro-batches, as even as possible, larger ones first (``tensor_split``)."""
    if chunks < 1:
        raise ValueError(f"chunks must be ≥ 1, got {chunks}")
    if N < 1:
        raise ValueError("cannot split an empty batch (N = 0) into micro-batches")
    M = min(chunks, N)
    return [N // M + (1 if m < N % M else 0) for m in range(M)]


def split_by_sizes(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split every batched tensor of ``batch`` along dim 0 into pieces of ``sizes`` (views, no copies)."""
    leaves, spec = tree_flatten(batch)
    pieces = [leaf.split(list(sizes)) if _is_batched(leaf) else None for leaf in leaves]
    return [
        tree_unflatten([p[m] if p is not None else leaf for p, leaf in zip(pieces, leaves)], spec)
        for m in range(len(sizes))
    ]


def split(batch: Any, chunks: int) -> list[Any]:
    """Split ``batch`` into M = min(chunks, N) micro-batches; warns once when N < chunks."""
    N = batch_size(batch)
    if 0 < N < chunks:
        warnings.warn(
            f"the batch has {N} samples, fewer than chunks={chunks}: running {N} micro-batches of one sample",
            stacklevel=2,
        )
    return split_by_sizes(batch, micro_batch_sizes(N, chunks))


def join(micro_batches: Sequence[Any]) -> Any:
    """Concatenate M micro-batch structures back into one batch along dim 0 (inverse of :func:`split`)."""
    if not micro_batches:
        raise ValueError("nothing to join: got zero micro-batches")
    flat = [tree_flatten(mb) for mb in micro_batches]
    leaves0, spec = flat[0]
    for m, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(f"micro-batch {m} has structure {other}, but micro-batch 0 has {spec}; cannot join them")
    joined = []
    for i, leaf in enumerate(leaves0):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    "a micro-batch output holds a 0-dim tensor, which has no batch dimension to join along; "
                    "return per-sample values (shape [n, ...]) from the pipelined module"
                )
            joined.append(torch.cat([leaves[i] for leaves, _ in flat]))
        else:
            joined.append(leaf)
    return tree_unflatten(joined, spec)


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure, in flattening order."""
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def detached(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def split_leaves(batch: Any, chunks: int) -> tuple[list[Any], list[torch.Tensor]]:
    """Split into micro-batches of fresh autograd leaves, each needing a gradient where the original tensor does;
    also return those originals, into which the joined micro-batch gradients are back-propagated at the end."""
    leaves, _ = tree_flatten(batch)
    wants = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    micro = []
    for mb in split(detached(batch), chunks):
        mb_leaves, mb_spec = tree_flatten(mb)
        fresh = [x.detach().requires_grad_(w) if isinstance(x, torch.Tensor) else x for x, w in zip(mb_leaves, wants)]
        micro.append(tree_unflatten(fresh, mb_spec))
    return micro, [x for x, w in zip(leaves, wants) if w]


def micro_batch_weights(sizes: Sequence[int]) -> list[float]:
    """n_m / N: the weight that makes per-micro-batch means of a loss add up to the mean over the whole batch."""
    N = sum(sizes)
    return [n / N for n in sizes]
