"""The dp mean of a stage's own gradients, each bucket launched as soon as its gradients are final, as DDP does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe.dp.grads import (
    SMALL_BUCKET_BYTES,
    BucketedAllReduce,
    PendingReduction,
    group_size,
    launch_bucket,
    used_somewhere,
    voting_group,
)
from lightning_gpipe.pipe.dp.hierarchy import Hierarchy


class ReadyBuckets:
    """Reduces ``params``' gradients over ``dp_group`` during the stage's last backward op.

    :meth:`arm` runs right before that op: the replicas agree on the parameters taking part (those with a gradient
    from an earlier micro-batch on some replica) and a hook on each counts its gradient in. The buckets are planned
    in reverse order (the last layers' gradients are final first), the last of them cut into buckets of at most
    ``tail_bytes`` (None: not cut), and launched strictly in that order, each once
    all of its gradients are in and those before it left, so every replica issues the same collectives in the same
    order. :meth:`launch_rest` then (after the op) launches what is left, and the parameters whose first gradient
    came in that op (another small agreement, always made); ``wait()`` on its result finishes the mean. Each
    element is the same sum over the same replicas as :class:`BucketedAllReduce` makes, divided as it divides
    (float16 and bfloat16 before the sum). The agreements run over ``vote_group`` (see :class:`BucketedAllReduce`):
    in :meth:`arm` on a gloo one the host goes on queueing the last op's backward without waiting for the GPU.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        bucket_bytes: int,
        hierarchy: Hierarchy | None = None,
        tail_bytes: int | None = SMALL_BUCKET_BYTES,
        vote_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dp_group, self.bucket_bytes, self.hierarchy = dp_group, bucket_bytes, hierarchy
        self.vote_group = voting_group(dp_group, vote_group)
        self.tail_bytes = tail_bytes
        self._reduce: BucketedAllReduce | None = None
        self._planned: set[int] = set()
        self._missing: list[int] = []  # per bucket: gradients not in yet
        self._bucket_of: dict[int, int] = {}
        self._handles: list[Any] = []
        self._launched: list[tuple[list[nn.Parameter], Any, Any]] = []

    def arm(self) -> None:
        """Before the stage's last backward op (collective over the replicas)."""
        if group_size(self.dp_group) == 1:
            return
        assert self.vote_group is not None
        active = used_somewhere(self.params, self.vote_group)
        reduce = self._reduce
        if reduce is None or [id(p) for p in reduce.params] != [id(p) for p in reversed(active)]:
            # The last bucket's gradients are final only as the op ends, so all of it is reduced after: it is cut
            # into small buckets, which leave one by one as the stage's first layers finish (DDP makes its first
            # bucket small for the mirror reason: to start early).
            reduce = self._reduce = BucketedAllReduce(
                list(reversed(active)),
                self.dp_group,
                self.bucket_bytes,
                self.hierarchy,
                self.tail_bytes,
                self.vote_group,
            )
        self._planned = {id(p) for p in active}
        self._missing = [len(b) for b in reduce.buckets]
        self._bucket_of = {id(p): i for i, b in enumerate(reduce.buckets) for p in b}
        self._launched = []
        self._handles = [p.register_post_accumulate_grad_hook(self._in) for p in active]

    def _in(self, p: nn.Parameter) -> None:
        i = self._bucket_of.get(id(p))
        if i is None or self._missing[i] <= 0:
            return
        self._missing[i] -= 1
        self._launch_ready()

    def _launch_ready(self, all_left: bool = False) -> None:
        reduce = self._reduce
        assert reduce is not None
        world = group_size(self.dp_group)
        while len(self._launched) < len(reduce.buckets):
            i = len(self._launched)
            if self._missing[i] > 0 and not all_left:
                return
            bucket, buffer = reduce.buckets[i], reduce.buffer(i)
            self._launched.append((bucket, buffer, launch_bucket(bucket, buffer, world, self.dp_group, self.hierarchy)))

    def launch_rest(self) -> PendingReduction:
        """After the last backward op: the buckets not launched yet, then the late parameters' own reduction."""
        world = group_size(self.dp_group)
        if world == 1:
            return PendingReduction(world, [])
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._launch_ready(all_left=True)
        pending = PendingReduction(world, self._launched)
        late = [p for p in self.params if id(p) not in self._planned]
        if late:  # every replica passes the same list: the agreement inside start() finds which have gradients
            late_pending = BucketedAllReduce(
                late, self.dp_group, self.bucket_bytes, self.hierarchy, vote_group=self.vote_group
            ).start()
            pending.pending.extend(late_pending.pending)
        return pending
