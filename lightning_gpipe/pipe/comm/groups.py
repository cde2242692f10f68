"""The process groups a pipeline's transport runs on, beside the pipeline group: headers, gradients, long skips."""

from __future__ import annotations

import torch.distributed as dist

from lightning_gpipe.pipe.comm import nccl_order
from lightning_gpipe.pipe.comm.transport import SkipGroups, skip_tags


def process_groups(
    group: dist.ProcessGroup | None, header_group: dist.ProcessGroup | None, upstream_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup] | None:
    """The pipeline's group (default: the world), a gloo group over its ranks for headers and status checks, and
    the group for upstream tensors (each made if not given); None when torch.distributed is not initialized: a
    single stage, with no peers."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        group = dist.group.WORLD
        assert group is not None, "torch.distributed is initialized"
    if upstream_group is None:
        upstream_group = upstream_group_for(group)
    check_upstream_group(group, upstream_group)
    return group, header_group if header_group is not None else cpu_group(group), upstream_group


def cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Headers and status checks are read on the CPU: with NCCL they need a gloo group over the same ranks."""
    if dist.get_backend(group) == "gloo":
        return group
    if group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"the pipeline group uses {dist.get_backend(group)!r}; pass header_group=, a gloo group over the same "
            "ranks (dist.new_group(ranks, backend='gloo'), created on every rank of the world)"
        )
    headers = dist.new_group(backend="gloo")
    assert isinstance(headers, dist.ProcessGroup), "every rank is a member of a group over all ranks"
    return headers


def runs_in_order(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s transfers run in posting order: NCCL, or gloo in ``nccl_order``'s test mode."""
    return "nccl" in str(dist.get_backend(group)).lower() or nccl_order.enabled()


def upstream_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group for the tensors that flow to lower stages: a second group over ``group``'s ranks where transfers
    run in order (see ``runs_in_order``); elsewhere ``group`` itself, as gloo matches by tag and buffers sends."""
    if not runs_in_order(group):
        return group
    backend = str(dist.get_backend(group))
    if group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"the pipeline group uses {backend!r}, which runs a group's transfers in posting order, so activations "
            "and gradients on one group can deadlock; pass upstream_group=, a second group over the same ranks "
            f"(dist.new_group(ranks, backend={backend!r}), created on every rank of the world)"
        )
    upstream = dist.new_group(backend=backend)
    assert isinstance(upstream, dist.ProcessGroup), "every rank is a member of a group over all ranks"
    return upstream


def check_upstream_group(group: dist.ProcessGroup, upstream: dist.ProcessGroup) -> None:
    """``upstream`` must hold ``group``'s ranks in the same order, and be another group where order matters."""
    ranks, up_ranks = dist.get_process_group_ranks(group), dist.get_process_group_ranks(upstream)
    if up_ranks != ranks:
        raise ValueError(
            f"upstream_group holds the ranks {up_ranks}, but the pipeline group holds {ranks}: pass a group over the "
            "same ranks, in the same order"
        )
    if upstream is group and runs_in_order(group):
        raise ValueError(
            "upstream_group is the pipeline group itself, whose transfers run in posting order, so activations and "
            "gradients on one group can deadlock; pass a second group over the same ranks"
        )


def skip_groups(group: dist.ProcessGroup, rank: int, pairs: list[tuple[int, int]], K: int) -> SkipGroups:
    """Where transfers run in posting order (see ``runs_in_order``): for each pair (s, p) of stages that long skips
    cross (``skips.skip_pairs``; stage s on rank s % K) between this rank and another, a group over the two ranks
    for the skips and one for their gradients, by the data tag each carries (``transport.skip_tags``).

    Groups are made by every rank of the world in one order (a group made by its members alone would still advance
    their count of groups, and the next group over the world would then get another name on the other ranks): with
    data-parallel replicas of the pipeline, the pairs of each, whose ranks are gathered over the world first."""
    if not runs_in_order(group) or not pairs:
        return {}
    ranks, backend = tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group))
    pipelines: list[tuple[int, ...]] = [ranks]
    if len(ranks) != dist.get_world_size():
        gathered: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ranks)
        pipelines = sorted({p for p in gathered if p is not None})
    out: SkipGroups = {}
    for pipeline in pipelines:
        for i, (s, p) in enumerate(pairs):
            a, b = s % K, p % K
            if a == b:  # two virtual stages of one rank: handed over in the process
                continue
            for tag in skip_tags(i):
                made = dist.new_group([pipeline[a], pipeline[b]], backend=backend)
                if pipeline == ranks and rank in (a, b):
                    assert isinstance(made, dist.ProcessGroup), "a member"
                    out[tag + 1] = (made, dist.get_group_rank(made, pipeline[b if rank == a else a]))
    return out
