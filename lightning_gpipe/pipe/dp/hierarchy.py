"""Jizhi's hierarchical all-reduce: sum within each node, all-reduce across nodes among one rank each, broadcast.

With N nodes of r replicas each and ring all-reduces (gloo's, NCCL's), a flat reduction is one ring of N·r ranks:
each node sends 2(Nr − 1)/(Nr) of the buffer over its link, in 2(Nr − 1) latency-bound steps. The hierarchical
one rings only the N leaders: 2(N − 1)/N of the buffer per node, in 2(N − 1) steps — 1.5× fewer bytes at 2 nodes,
about the same at many, and r× fewer steps over the slow links (``benchmarks/dp_cost_model.py``). Sums: each
node's part first, then across nodes, so the result equals the flat sum up to fp32 rounding (exactly for integer
values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Hierarchy:
    """This rank's part of the hierarchical reduction over a data-parallel group.

    ``intra`` holds the group's ranks on this node (``leader`` first), ``inter`` the leaders of every node (``None``
    on a rank that leads none). Build it with :func:`build_hierarchies`, collectively.
    """

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    leader: int  # global rank of this node's leader
    nodes: int

    def all_reduce(self, buffer: torch.Tensor) -> Any:
        """Start the sum of ``buffer`` over the whole group; ``wait()`` on the result finishes it (in place)."""
        first = None
        if self.intra is not None:
            first = dist.reduce(buffer, dst=self.leader, group=self.intra, async_op=True)
        return _Rest(self, buffer, first)


class _Rest:
    """The steps after the intra-node reduce, run in order by ``wait()`` (every rank of a group issues its
    collectives in the same order: the buckets' reduces at launch, then per bucket the rest)."""

    def __init__(self, h: Hierarchy, buffer: torch.Tensor, first: Any) -> None:
        self.h, self.buffer, self.first = h, buffer, first

    def wait(self) -> bool:
        if self.first is not None:
            self.first.wait()
        if self.h.inter is not None:
            dist.all_reduce(self.buffer, group=self.h.inter)
        if self.h.intra is not None:
            dist.broadcast(self.buffer, src=self.h.leader, group=self.h.intra)
        return True


def build_hierarchies(
    groups: Sequence[Sequence[int]], node_of: Callable[[int], int], rank: int, backend: str | None = None
) -> Hierarchy | None:
    """This rank's :class:`Hierarchy` within the one of ``groups`` (every data-parallel group, alike on every rank)
    that holds it; collective over the world (``new_group`` for every node's part and every group's leaders).
    ``None`` when this rank is in no group."""
    mine: Hierarchy | None = None
    for ranks in groups:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(node_of(r), []).append(r)
        leaders = [members[0] for members in by_node.values()]
        made = {node: _group(members, backend) for node, members in by_node.items()}
        inter = _group(leaders, backend)
        if rank in ranks:
            node = node_of(rank)
            members = by_node[node]
            mine = Hierarchy(made[node], inter if rank == members[0] else None, members[0], len(by_node))
    return mine


def _group(ranks: list[int], backend: str | None) -> dist.ProcessGroup | None:
    """A group of ``ranks`` (collective over the world), or None for one rank, which needs no step."""
    if len(ranks) < 2:
        return None
    group = dist.new_group(ranks, backend=backend)
    return group if isinstance(group, dist.ProcessGroup) else None
