"""GPipeStrategy's collectives: reductions over the data-parallel replicas, decisions over every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor


class Collectives:
    """Mixed into GPipeStrategy (before ParallelStrategy): Lightning's collective hooks on the (dp × K) mesh."""

    _dp_group: Any
    _pp_group: Any
    pipeline_parallel_size: int
    global_rank: int
    root_device: torch.device
    world_size: int

    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        # Values are identical on the stages of a pipeline; sync_dist reduces over the data-parallel replicas.
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self._dp_group, reduce_op=reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # The parent sums the votes with self.reduce (over the replicas only) and compares them with the world size;
        # ModelCheckpoint and EarlyStopping need one answer, the same on every rank.
        if not _distributed_is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def _cpu_pipeline_group(self) -> Any:
        """The engine reads headers and status on the CPU: with NCCL it needs gloo groups over the same ranks."""
        if dist.get_backend(self._pp_group) == "gloo":
            return self._pp_group
        K, mine = self.pipeline_parallel_size, None
        for start in range(0, self.world_size, K):  # new_group is collective over the world: all create all
            group = dist.new_group(list(range(start, start + K)), backend="gloo")
            if start <= self.global_rank < start + K:
                mine = group
        return mine
