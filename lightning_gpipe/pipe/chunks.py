"""Interleaving (``virtual_stages`` = v ≥ 2): the v chunks a rank holds, rank r the stages r, r + K, …, r + (v−1)K."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.partition import Balance, agree_on_balance, local_name, shared_parameters


def held_stages(rank: int, K: int, v: int) -> list[int]:
    """The stages (of vK) that rank ``rank`` of K holds, in order: chunk c is stage c·K + rank."""
    return [c * K + rank for c in range(v)]


def rank_holders(stages: Sequence[int], K: int) -> tuple[int, ...]:
    """The ranks that hold ``stages`` (of vK): a weight tied across two chunks of one rank is one parameter there."""
    return tuple(sorted({s % K for s in stages}))


def shared_over_ranks(
    module: nn.Sequential, balance: Sequence[int], K: int, rank: int, layers: list[tuple[str, nn.Module]]
) -> list[tuple[str, tuple[int, ...], str | None]]:
    """Tied weights used on several ranks: (first name, the ranks holding it, the name of one of its uses among
    ``layers``, this rank's, or None); ``balance`` has a count per stage (vK with interleaving)."""
    return [
        (name, ranks, local_name(layers, module.get_parameter(name)) if rank in ranks else None)
        for name, stages in shared_parameters(module, balance)
        if len(ranks := rank_holders(stages, K)) > 1
    ]


def check_virtual_stages(v: object, K: int) -> int:
    """``virtual_stages`` as an int ≥ 1, or a clear ValueError (also for v ≥ 2 on a pipeline of one rank)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(
            f"virtual_stages (v, the chunks each rank holds) must be an int ≥ 1, got {v!r}; 1 runs one contiguous "
            "stage per rank, v ≥ 2 interleaves (schedule='interleaved-1f1b')"
        )
    if v > 1 and K == 1:
        raise ValueError(
            f"virtual_stages={v} interleaves chunks over the ranks of a pipeline, but this pipeline has one rank "
            "(torch.distributed is not initialized, or the group has one rank): there is no bubble to shrink; use "
            "virtual_stages=1"
        )
    return v


def agree_on_chunks(
    module: nn.Sequential, K: int, v: int, balance: Balance, sample: Any, group: dist.ProcessGroup | None
) -> list[int]:
    """The layer counts of the vK stages (chunks), the same on every rank (see ``agree_on_balance``)."""
    try:
        return agree_on_balance(module, K * v, balance, sample=sample, group=group)
    except ValueError as e:
        if v == 1:
            raise
        raise ValueError(
            f"{e} (virtual_stages={v}: the pipeline's stages are its K·v = {K}·{v} = {K * v} chunks, rank r holding "
            f"chunks r, r + {K}, …; a balance gives one layer count per chunk)"
        ) from e


class ChunkLayers(nn.Module):
    """One chunk's layers under their global names: what its executor runs, normalizes and watches.

    Never registered in the stage (its state dict holds each layer once, under the plain module's key); it looks its
    layers up in the stage before every phase, as a layer may be replaced there (a BatchNorm reverted, say)."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__()
        self.names = list(names)

    def refresh(self, layers: Mapping[str, nn.Module | None]) -> None:
        for name in self.names:
            self._modules[name] = layers[name]
