"""The process groups a pipeline's transport runs on, beside the pipeline group: headers, links, long skips."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from lightning_gpipe.pipe.comm import nccl_order
from lightning_gpipe.pipe.comm.transport import LinkGroups, SkipGroups, skip_tags
from lightning_gpipe.pipe.schedule.registry import Placement, rank_of


def process_groups(
    group: dist.ProcessGroup | None, header_group: dist.ProcessGroup | None, timeout: timedelta
) -> tuple[dist.ProcessGroup, dist.ProcessGroup] | None:
    """The pipeline's group (default: the world) and a gloo group over its ranks for headers and status checks (made
    if not given); None when torch.distributed is not initialized: a single stage, with no peers."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        group = dist.group.WORLD
        assert group is not None, "torch.distributed is initialized"
    return group, header_group if header_group is not None else cpu_group(group, timeout)


def cpu_group(group: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup:
    """Headers and status checks are read on the CPU: with NCCL they need a gloo group over the same ranks."""
    if dist.get_backend(group) == "gloo":
        return group
    if group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"the pipeline group uses {dist.get_backend(group)!r}; pass header_group=, a gloo group over the same "
            "ranks (dist.new_group(ranks, backend='gloo'), created on every rank of the world)"
        )
    headers = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(headers, dist.ProcessGroup), "every rank is a member of a group over all ranks"
    return headers


def runs_in_order(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s transfers run in posting order: NCCL, or gloo in ``nccl_order``'s test mode."""
    return "nccl" in str(dist.get_backend(group)).lower() or nccl_order.enabled()


def data_timeout(timeout: timedelta) -> timedelta:
    """The timeout of the groups that carry tensors: longer than the host's waits (``timeout``). On NCCL the host
    never waits for tensor data, only on gloo headers and status checks; where a peer hangs, such a wait raises
    PipelineTimeout and the failure path aborts these groups before NCCL's watchdog, which counts from the earlier
    posting of a transfer, would end the process with SIGABRT over it."""
    return timeout + max(timedelta(seconds=30), timeout / 2)


def links_of(K: int, placement: Placement = "loop") -> list[tuple[int, int]]:
    """The directed pairs of a pipeline's K ranks that carry tensors: each rank to both its neighbours on the ring
    (activations and gradients; an interleaved pipeline's hop from rank K − 1 to rank 0 and back; a V has no hop),
    and the last stage's rank (K − 1; rank 0 in a V) to every other (the shared output)."""
    pairs: list[tuple[int, int]] = []
    for k in range(K):
        for peer in ((k + 1) % K, (k - 1) % K) if placement == "loop" else (k + 1, k - 1):
            if 0 <= peer < K and peer != k and (k, peer) not in pairs:
                pairs.append((k, peer))
    last = rank_of(2 * K - 1, K, placement) if placement == "v" else K - 1  # the rank of the last stage
    pairs += [(last, j) for j in range(K) if j != last and (last, j) not in pairs]
    return pairs


def link_groups(
    group: dist.ProcessGroup, rank: int, K: int, timeout: timedelta, placement: Placement = "loop"
) -> LinkGroups:
    """Where transfers run in posting order (see ``runs_in_order``): a group over the two ranks of each link of
    ``links_of`` for its tensors, one per direction, so that no stage's receive waits behind its own send on one
    queue and no tensor travels on the pipeline's group (the world's at dp = 1, which every collective shares),
    each with :func:`data_timeout` of the pipeline's ``timeout``. Elsewhere (gloo) none: tags keep the pipeline
    group's messages apart.

    Made by every rank of the world in one order (see :func:`skip_groups`)."""
    if not runs_in_order(group) or K < 2:
        return {}
    ranks, backend = tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group))
    out: LinkGroups = {}
    # At K = 2 each direction carries activations and input gradients (interleaving's hop runs back along the
    # other's link), in a V at every K (chunk a's activations go down beside chunk b's gradients), which each end
    # may post in its own order: a group for each kind.
    kinds = (False, True) if K == 2 or placement == "v" else (False,)
    for pipeline in _pipelines(ranks):
        for src, dst in links_of(K, placement):
            for gradients in kinds:
                made = dist.new_group([pipeline[src], pipeline[dst]], backend=backend, timeout=data_timeout(timeout))
                if pipeline == ranks and rank in (src, dst):
                    assert isinstance(made, dist.ProcessGroup), "a member"
                    peer = dist.get_group_rank(made, pipeline[dst if rank == src else src])
                    out[src, dst, gradients] = (made, peer)
    return out


def _pipelines(ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The global ranks of every pipeline of the world (this one's: ``ranks``), in one order on every rank."""
    if len(ranks) == dist.get_world_size():
        return [ranks]
    gathered: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ranks)
    return sorted({p for p in gathered if p is not None})


def skip_groups(
    group: dist.ProcessGroup, rank: int, pairs: list[tuple[int, int]], homes: Sequence[int], timeout: timedelta
) -> SkipGroups:
    """Where transfers run in posting order (see ``runs_in_order``): for each pair (s, p) of stages that long skips
    cross (``skips.skip_pairs``; stage s on rank ``homes[s]``) between this rank and another, a group over the two ranks
    for the skips and one for their gradients, by the data tag each carries (``transport.skip_tags``).

    Groups are made by every rank of the world in one order (a group made by its members alone would still advance
    their count of groups, and the next group over the world would then get another name on the other ranks): with
    data-parallel replicas of the pipeline, the pairs of each, whose ranks are gathered over the world first."""
    if not runs_in_order(group) or not pairs:
        return {}
    ranks, backend = tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group))
    out: SkipGroups = {}
    for pipeline in _pipelines(ranks):
        for i, (s, p) in enumerate(pairs):
            a, b = homes[s], homes[p]
            if a == b:  # two virtual stages of one rank: handed over in the process
                continue
            for tag in skip_tags(i):
                made = dist.new_group([pipeline[a], pipeline[b]], backend=backend, timeout=data_timeout(timeout))
                if pipeline == ranks and rank in (a, b):
                    assert isinstance(made, dist.ProcessGroup), "a member"
                    out[tag + 1] = (made, dist.get_group_rank(made, pipeline[b if rank == a else a]))
    return out
