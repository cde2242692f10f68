"""Split nested batches into M micro-batches along the batch dimension and join them back.

What is split, and how:

* A tensor with at least one dimension is batched: it is split along ``batch_dim`` (0 by default; 1 for time-major
  ``(T, N, ...)`` tensors) into consecutive slices of the micro-batch sizes, and joined back by concatenation. Every
  batched tensor must have the same size N along ``batch_dim``.
* A list or tuple that holds no tensor and whose length equals N is per-sample (strings, ids, token lists): it is
  split into consecutive slices of the micro-batch sizes, like a tensor, and joined back by concatenation.
* Anything else -- 0-dim tensors, strings, numbers, None, namedtuples, sequences of another length -- is copied to
  every micro-batch (and taken from micro-batch 0 when joining).

The length decides, so a constant list that happens to have N entries is split, and when joining, one that has n_m
entries in every micro-batch m is concatenated: keep such constants out of the batch and of the pipeline's output,
or give them another length.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from lightning_gpipe.pipe._torch_internals import tree_flatten, tree_unflatten


def _is_batched(leaf: Any) -> bool:
    # 0-dim tensors have no batch dimension: they are replicated like any other non-tensor value.
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0


def _is_plain_sequence(x: Any) -> bool:
    # Exactly list or tuple: a namedtuple is a record of fields, not a sequence of samples.
    return type(x) in (list, tuple) and not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(x)[0])


def _flatten(batch: Any) -> tuple[list[Any], Any]:
    """Leaves of ``batch``, where a tensor-free list or tuple is one leaf (it may be per-sample)."""
    return tree_flatten(batch, is_leaf=_is_plain_sequence)


def _is_per_sample(leaf: Any, n: int) -> bool:
    return _is_plain_sequence(leaf) and len(leaf) == n


def is_per_sample_sequence(batch: Any, n: int) -> bool:
    """Whether ``batch`` holds a list or tuple that is split and joined per sample when there are ``n`` samples."""
    return any(_is_per_sample(leaf, n) for leaf in _flatten(batch)[0])


def _check_dims(t: torch.Tensor, batch_dim: int) -> None:
    if t.dim() <= batch_dim:
        raise ValueError(
            f"batch_dim={batch_dim}, but a tensor of shape {tuple(t.shape)} has no dimension {batch_dim}: every "
            f"tensor with a batch dimension must hold the samples along dim {batch_dim} (batch_dim=1 is for "
            "time-major (T, N, ...) tensors, batch_dim=0 for batch-first ones); 0-dim tensors are copied to every "
            "micro-batch"
        )


_DISAGREE_FIX = (
    "If another dimension holds the samples (time-major (T, N, ...) tensors: batch_dim=1), set batch_dim to it; "
    "a tensor that is the same for every sample (a mask over the vocabulary) is not split: keep it out of the "
    "batch (a module buffer), or make it 0-dim"
)


def batch_size(batch: Any, batch_dim: int = 0) -> int:
    """N, the common size along ``batch_dim`` of every batched tensor in ``batch``; errors if they disagree or there
    are none."""
    leaves, _ = _flatten(batch)
    batched = [leaf for leaf in leaves if _is_batched(leaf)]
    for t in batched:
        _check_dims(t, batch_dim)
    sizes = {t.shape[batch_dim] for t in batched}
    if not sizes:
        raise ValueError(
            "the batch holds no tensor with a batch dimension to split into micro-batches; "
            f"pass at least one tensor whose dim {batch_dim} is the batch"
        )
    if len(sizes) > 1:
        shapes = [tuple(t.shape) for t in batched]
        raise ValueError(
            f"tensors in the batch disagree on the batch size (dim {batch_dim}): shapes {shapes}; "
            f"every tensor that is split into micro-batches needs the same dim-{batch_dim} size. {_DISAGREE_FIX}"
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


def split_by_sizes(batch: Any, sizes: Sequence[int], batch_dim: int = 0) -> list[Any]:
    """Split ``batch`` into pieces of ``sizes``: batched tensors along ``batch_dim`` (views, no copies), per-sample
    sequences into slices; everything else is copied to every piece."""
    N = sum(sizes)
    leaves, spec = _flatten(batch)
    pieces: list[Any] = []
    for leaf in leaves:
        if _is_batched(leaf):
            _check_dims(leaf, batch_dim)
            if leaf.shape[batch_dim] != N:  # torch.split would say only that the sizes do not add up
                raise ValueError(
                    f"a tensor of shape {tuple(leaf.shape)} has {leaf.shape[batch_dim]} entries along dim {batch_dim} "
                    f"(batch_dim={batch_dim}), but the batch split into micro-batches of {list(sizes)} has {N} "
                    f"samples. {_DISAGREE_FIX}"
                )
            pieces.append(leaf.split(list(sizes), dim=batch_dim))
        elif _is_per_sample(leaf, N):
            bounds = list(itertools.accumulate(sizes, initial=0))
            pieces.append([leaf[a:b] for a, b in itertools.pairwise(bounds)])
        else:
            pieces.append(None)
    return [
        tree_unflatten([p[m] if p is not None else leaf for p, leaf in zip(pieces, leaves)], spec)
        for m in range(len(sizes))
    ]


def plan_sizes(batch: Any, chunks: int, batch_dim: int = 0) -> list[int]:
    """The micro-batch sizes :func:`split` uses for ``batch``; warns once when N < chunks."""
    N = batch_size(batch, batch_dim)
    if 0 < N < chunks:
        warnings.warn(
            f"the batch has {N} samples, fewer than chunks={chunks}: running {N} micro-batches of one sample",
            stacklevel=3,
        )
    return micro_batch_sizes(N, chunks)


def split(batch: Any, chunks: int, batch_dim: int = 0) -> list[Any]:
    """Split ``batch`` into M = min(chunks, N) micro-batches along ``batch_dim``; warns once when N < chunks."""
    return split_by_sizes(batch, plan_sizes(batch, chunks, batch_dim), batch_dim)


def join(micro_batches: Sequence[Any], batch_dim: int = 0, sizes: Sequence[int] | None = None) -> Any:
    """Concatenate M micro-batch structures back into one batch along ``batch_dim`` (inverse of :func:`split`).

    ``sizes`` (the micro-batch sizes) tells per-sample sequences apart; by default read from the batched tensors.
    """
    if not micro_batches:
        raise ValueError("nothing to join: got zero micro-batches")
    flat = [_flatten(mb) for mb in micro_batches]
    leaves0, spec = flat[0]
    for m, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(f"micro-batch {m} has structure {other}, but micro-batch 0 has {spec}; cannot join them")
    joined = []
    for i, leaf in enumerate(leaves0):
        column = [leaves[i] for leaves, _ in flat]
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise ValueError(
                    "a micro-batch output holds a 0-dim tensor, which has no batch dimension to join along; "
                    "return per-sample values (shape [n, ...]) from the pipelined module"
                )
            joined.append(torch.cat(column, dim=batch_dim))
            continue
        if _is_plain_sequence(leaf):
            if sizes is None:
                sizes = [batch_size(mb, batch_dim) for mb in micro_batches]
            # Per-sample only if it is in every micro-batch: a constant list must not be joined M times over.
            if all(_is_per_sample(c, n) for c, n in zip(column, sizes)):
                joined.append(type(leaf)(itertools.chain.from_iterable(column)))
                continue
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


def split_leaves(batch: Any, sizes: Sequence[int], batch_dim: int = 0) -> tuple[list[Any], list[torch.Tensor]]:
    """Split into micro-batches of fresh autograd leaves, each needing a gradient where the original tensor does;
    also return those originals, into which the joined micro-batch gradients are back-propagated at the end."""
    leaves, _ = _flatten(batch)
    wants = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    micro = []
    for mb in split_by_sizes(detached(batch), sizes, batch_dim):
        mb_leaves, mb_spec = _flatten(mb)
        fresh = [x.detach().requires_grad_(w) if isinstance(x, torch.Tensor) else x for x, w in zip(mb_leaves, wants)]
        micro.append(tree_unflatten(fresh, mb_spec))
    return micro, [x for x, w in zip(leaves, wants) if w]


def join_input_grads(grads: Sequence[Sequence[torch.Tensor]], batch_dim: int = 0) -> list[torch.Tensor]:
    """Per input leaf, the gradient of the whole batch from the micro-batches' ones: concatenated along the batch
    dimension, or summed for a 0-dim leaf, which every micro-batch used whole."""
    return [torch.cat(col, dim=batch_dim) if col[0].dim() else torch.stack(col).sum(0) for col in zip(*grads)]


def micro_batch_weights(sizes: Sequence[int]) -> list[float]:
    """n_m / N: the weight that makes per-micro-batch means of a loss add up to the mean over the whole batch."""
    N = sum(sizes)
    return [n / N for n in sizes]
