"""The processes of GPipeStrategy: the (data_parallel × pipeline_parallel) mesh and groups, world collectives, exit."""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.pipe.dp.hierarchy import Hierarchy, build_hierarchies
from lightning_gpipe.strategy._arguments import DpReduction, Layout
from lightning_gpipe.strategy._lightning_internals import init_dist_connection, logger

T = TypeVar("T")


@dataclass(frozen=True)
class PipelineMesh:
    """Global rank ``rank = d·K + k`` is stage ``k`` of data-parallel replica ``d`` (``layout="stages_together"``: a
    pipeline's stages on consecutive ranks, so on one node where it has ≥ K devices), or ``rank = k·D + d``
    (``"replicas_together"``: a stage's D replicas on consecutive ranks, so FSDP's gathers stay inside a node and the
    pipeline crosses nodes). With T > 1 each of them is T consecutive ranks, the tensor-parallel group of a stage of a
    replica (``device_mesh["tensor_parallel"]``).

    ``pp_group`` holds the K stages of this rank's pipeline, ``dp_group`` the replicas of this rank's stage, and
    ``header_group`` the same ranks as ``pp_group`` over gloo: the engine reads headers and status on the CPU (and
    the stages vote there on which copied gradients to sum). ``dp_cpu_group``: the same ranks as ``dp_group`` over
    gloo, where the replicas vote on which gradients to average: a host-side fact, read without waiting for the GPU.
    ``timeout_s``: how long a rank waits for another, the process groups' timeout. ``dp_hierarchy``: this rank's
    part of the hierarchical data-parallel reduction, or None for the flat one. ``input_group``: the pipeline's
    stages over gloo for the batches stage 0 loads for them (``data_loading="first_stage"``), else None.
    """

    K: int
    rank: int
    device_mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    header_group: dist.ProcessGroup
    dp_cpu_group: dist.ProcessGroup
    timeout_s: float
    dp_hierarchy: Hierarchy | None = None
    input_group: dist.ProcessGroup | None = None
    grid: list[list[list[int]]] = field(default_factory=list)  # [d][k][t]: the global rank

    @classmethod
    def join(
        cls,
        environment: ClusterEnvironment,
        backend: str,
        timeout: timedelta | None,
        device: torch.device,
        K: int,
        per_node: int = 1,
        dp_reduction: DpReduction = "flat",
        input_group: bool = False,
        layout: Layout = "stages_together",
        T: int = 1,
    ) -> PipelineMesh:
        """Join the world's process group (as Lightning's strategies do), then lay the mesh out over it: T
        tensor-parallel ranks of a stage innermost (consecutive ranks), then the two others in ``layout``'s order."""
        init_dist_connection(environment, backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
        destroy_at_exit()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        # The outer dimension first: its neighbours are the furthest apart.
        names = ("data_parallel", "pipeline_parallel", "tensor_parallel")
        if layout == "replicas_together":
            names = ("pipeline_parallel", "data_parallel", "tensor_parallel")
        sizes = {"pipeline_parallel": K, "tensor_parallel": T, "data_parallel": world_size // (K * T)}
        mesh = init_device_mesh(device.type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        pipelines, replicas = _rank_sets(mesh, "pipeline_parallel"), _rank_sets(mesh, "data_parallel")
        pp_group, dp_group = mesh["pipeline_parallel"].get_group(), mesh["data_parallel"].get_group()
        wait = timeout or default_pg_timeout
        header_group = pp_group if dist.get_backend(pp_group) == "gloo" else _own_group(pipelines, rank, wait)
        dp_cpu_group = dp_group if dist.get_backend(dp_group) == "gloo" else _own_group(replicas, rank, wait)
        # Its own group: the feed's thread broadcasts while the main thread talks on the others.
        inputs = _own_group(pipelines, rank, wait) if input_group and K > 1 else None
        hierarchy = None
        if hierarchical(dp_reduction, replicas, per_node):
            hierarchy = build_hierarchies(replicas, lambda r: r // per_node, rank)
            if rank == 0 and hierarchy is not None:
                logger.info(
                    f"GPipeStrategy: data-parallel reduction in steps over {hierarchy.nodes} nodes: within each node, "
                    "among one rank per node, then back (data_parallel_reduction='hierarchical')"
                )
        timeout_s = wait.total_seconds()
        grid = mesh.mesh.permute(*(names.index(n) for n in _GRID)).tolist()  # [d][k][t]
        args = (pp_group, dp_group, header_group, dp_cpu_group, timeout_s, hierarchy, inputs, grid)
        return cls(K, rank, mesh, *args)

    def rank_of(self, d: int, k: int, t: int = 0) -> int:
        """The global rank of stage ``k`` of replica ``d``, tensor-parallel rank ``t``."""
        return self.grid[d][k][t]

    @property
    def stage_ranks(self) -> list[list[int]]:
        """Each stage's global ranks, replica 0's tensor-parallel rank 0 first."""
        return [
            [self.grid[d][k][t] for d in range(len(self.grid)) for t in range(len(self.grid[0][0]))]
            for k in range(self.K)
        ]


_GRID = ("data_parallel", "pipeline_parallel", "tensor_parallel")


def hierarchical(dp_reduction: DpReduction, replicas: list[list[int]], per_node: int) -> bool:
    """Whether the dp reduction goes in Jizhi's steps: asked for, or ``"auto"`` where replicas of a stage share a
    node and others sit on other nodes (only then does a node's part save inter-node traffic). ``replicas``: each
    stage's ranks."""
    if dp_reduction != "auto":
        return dp_reduction == "hierarchical"
    nodes = [[r // per_node for r in ranks] for ranks in replicas]
    return any(len(set(n)) > 1 and len(set(n)) < len(n) for n in nodes)


def _rank_sets(mesh: DeviceMesh, dim: str) -> list[list[int]]:
    """The groups of ``mesh``'s dimension ``dim``, each in its order, in order of the other dimension."""
    ranks = mesh.mesh
    i = list(mesh.mesh_dim_names or ()).index(dim)
    return ranks.movedim(i, -1).reshape(-1, ranks.size(i)).tolist()


def _own_group(rank_sets: list[list[int]], rank: int, timeout: timedelta) -> dist.ProcessGroup:
    mine = None
    for ranks in rank_sets:  # new_group is collective over the world: all create all, in the same order
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if rank in ranks and isinstance(group, dist.ProcessGroup):
            mine = group
    assert mine is not None
    return mine


def default_backend(device: torch.device) -> str:
    """torch's backend for the device type (Lightning picks it so too); gloo for a type torch has none for."""
    return dist.Backend.default_device_backend_map.get(device.type, "gloo")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_vote(decision: bool, all: bool, device: torch.device, world_size: int) -> bool:
    """One answer on every rank: whether every rank (``all``) or any rank decided so."""
    if not initialized():
        return decision
    votes = torch.tensor(int(decision), device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    return bool(votes == world_size) if all else bool(votes > 0)


def world_barrier(device: torch.device) -> None:
    if not initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def world_broadcast(obj: T, src: int) -> T:
    if not initialized():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


# Destroys the process groups when a process that trained cleanly exits, while Python can still free their tensors.


# Without this, gloo's worker threads can still hold finished work (and its tensors) when the interpreter is torn
# down; freeing them then aborts the process ("terminate called without an active exception", exit code -6) after a
# run that succeeded. torch leaves the call to the application (pytorch/pytorch#190489); a Lightning user's script
# never makes it, so the strategy does. After a failure the groups are left alone: a peer may never answer, and
# destroying a group waits for its pending work.
#
# Destroying does not join gloo's worker threads while something still references a group, and such a thread drops
# its reference to the last collective's work only after waking the caller. Should that release come after the
# interpreter began finalizing, taking the GIL ends the thread by a forced unwind and the process aborts all the same
# (seen in benchmark workers: gdb showed ProcessGroupGloo::AsyncWork's destructor in that thread). The pause lets the
# threads get there first; under load they can be off the CPU for a few milliseconds.
_SETTLE_S = 0.05
_state = {"registered": False, "failed": False}


def destroy_at_exit() -> None:
    """Arrange (once per process) for the process groups to be destroyed at a clean exit."""
    _state["failed"] = False
    if not _state["registered"]:
        atexit.register(_destroy)
        _state["registered"] = True


def keep_at_exit() -> None:
    """A run failed: leave the process groups to the operating system."""
    _state["failed"] = True


def _destroy() -> None:
    if not _state["failed"] and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(_SETTLE_S)
