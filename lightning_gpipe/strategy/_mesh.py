"""The process layout of GPipeStrategy: a (data_parallel × pipeline_parallel) mesh, its groups, world collectives."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from lightning_gpipe.pipe.hierarchy import Hierarchy, build_hierarchies
from lightning_gpipe.pipe.transport import runs_in_order
from lightning_gpipe.strategy import _lightning_internals as internals
from lightning_gpipe.strategy._audit import logger
from lightning_gpipe.strategy._clean_exit import destroy_at_exit
from lightning_gpipe.strategy._lightning_internals import init_dist_connection

T = TypeVar("T")
DpReduction = Literal["auto", "flat", "hierarchical"]
DP_REDUCTIONS = ("auto", "flat", "hierarchical")


@dataclass(frozen=True)
class PipelineMesh:
    """Global rank ``rank = d·K + k`` is stage ``k`` of data-parallel replica ``d``.

    ``pp_group`` holds the K stages of this rank's pipeline, ``dp_group`` the replicas of this rank's stage, and
    ``header_group`` the same ranks as ``pp_group`` over gloo: the engine reads headers and status on the CPU (and
    the stages vote there on which copied gradients to sum). ``dp_cpu_group``: the same ranks as ``dp_group`` over
    gloo, where the replicas vote on which gradients to average: a host-side fact, read without waiting for the GPU.
    ``upstream_group``: the same ranks again, for the tensors that flow to lower stages, where one group would run
    both directions in one order (NCCL: see ``pipe.transport``), else ``pp_group``.
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
    upstream_group: dist.ProcessGroup
    timeout_s: float
    dp_hierarchy: Hierarchy | None = None
    input_group: dist.ProcessGroup | None = None

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
    ) -> PipelineMesh:
        """Join the world's process group (as Lightning's strategies do), then lay the mesh out over it."""
        init_dist_connection(environment, backend, timeout=timeout, device_id=device if device.type != "cpu" else None)
        destroy_at_exit()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        # Stages of one pipeline are consecutive ranks, so on multi-GPU nodes neighbours share a node.
        shape, names = (world_size // K, K), ("data_parallel", "pipeline_parallel")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        pp_group, dp_group = mesh["pipeline_parallel"].get_group(), mesh["data_parallel"].get_group()
        header_group = pp_group if dist.get_backend(pp_group) == "gloo" else _pipeline_groups(world_size, K, rank)
        dp_cpu_group = dp_group if dist.get_backend(dp_group) == "gloo" else _replica_groups(world_size, K, rank)
        upstream = pp_group
        if runs_in_order(pp_group):
            upstream = _pipeline_groups(world_size, K, rank, backend=str(dist.get_backend(pp_group)))
        # Its own group: the feed's thread broadcasts while the main thread talks on the others.
        inputs = _pipeline_groups(world_size, K, rank) if input_group and K > 1 else None
        hierarchy = None
        if hierarchical(dp_reduction, world_size, K, per_node):
            dp_groups = [list(range(k, world_size, K)) for k in range(K)]
            hierarchy = build_hierarchies(dp_groups, lambda r: r // per_node, rank)
            if rank == 0 and hierarchy is not None:
                logger.info(
                    f"GPipeStrategy: data-parallel reduction in steps over {hierarchy.nodes} nodes: within each node, "
                    "among one rank per node, then back (data_parallel_reduction='hierarchical')"
                )
        timeout_s = (timeout or default_pg_timeout).total_seconds()
        return cls(
            K, rank, mesh, pp_group, dp_group, header_group, dp_cpu_group, upstream, timeout_s, hierarchy, inputs
        )


def hierarchical(dp_reduction: DpReduction, world_size: int, K: int, per_node: int) -> bool:
    """Whether the dp reduction goes in Jizhi's steps: asked for, or ``"auto"`` where replicas of a stage share a
    node and others sit on other nodes (only then does a node's part save inter-node traffic)."""
    if dp_reduction != "auto":
        return dp_reduction == "hierarchical"
    return world_size > per_node and per_node > K


def _pipeline_groups(world_size: int, K: int, rank: int, backend: str = "gloo") -> dist.ProcessGroup:
    """A new group per pipeline (K consecutive ranks); this rank's."""
    return _own_group([list(range(start, start + K)) for start in range(0, world_size, K)], rank, backend)


def _replica_groups(world_size: int, K: int, rank: int, backend: str = "gloo") -> dist.ProcessGroup:
    """A new group per stage over its data-parallel replicas (the ranks of the mesh's dp groups); this rank's."""
    return _own_group([list(range(k, world_size, K)) for k in range(K)], rank, backend)


def _own_group(rank_sets: list[list[int]], rank: int, backend: str) -> dist.ProcessGroup:
    mine = None
    for ranks in rank_sets:  # new_group is collective over the world: all create all, in the same order
        group = dist.new_group(ranks, backend=backend)
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


class MeshCollectives(ParallelStrategy):
    """Lightning's collectives for a pipeline: ``sync_dist`` and ``all_gather`` over the replicas (as DDP over them),
    votes, barriers and broadcasts over the world."""

    @property
    @abstractmethod
    def _mesh(self) -> PipelineMesh: ...

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # Values are identical on the stages of a pipeline; sync_dist reduces over the data-parallel replicas.
        if isinstance(tensor, Tensor):
            return internals.sync_ddp_if_available(tensor, self._replicas(group), reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # As DDP over the replicas: one entry per replica (the stages of a pipeline hold the same values).
        return internals.all_gather_ddp_if_available(tensor, group=self._replicas(group), sync_grads=sync_grads)

    def _replicas(self, group: Any | None) -> Any:
        """The group a DDP run over the replicas would use for ``group``: its world is the replicas of this stage
        (``LightningModule.all_gather`` passes ``WORLD`` itself); any other group as given."""
        return self._mesh.dp_group if group is None or group is dist.group.WORLD else group

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Not ParallelStrategy's vote over the replicas only: ModelCheckpoint and EarlyStopping need every rank's.
        return world_vote(decision, all, self.root_device, self.world_size)

    @override
    def barrier(self, name: str | None = None) -> None:
        world_barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return world_broadcast(obj, src)
