"""Gradient synchronization for pipeline × data parallelism: pipeline sums and bucketed dp means."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.pipe.dp.hierarchy import Hierarchy

__all__ = [
    "BucketedAllReduce",
    "OverlappedReduction",
    "PendingReduction",
    "sum_over_pipeline",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20
# DDP's first-bucket size: a small bucket's all-reduce is short, wherever in the order it falls.
SMALL_BUCKET_BYTES = 2**20

_Key = tuple[torch.dtype, torch.device]

# Divided by the dp size before the sum, as DDP does: a float16 sum over many replicas can overflow before the
# division, the mean cannot. float32 and float64 sum first: one rounding fewer (both exact for a power-of-two dp size).
_DIVIDED_FIRST = (torch.float16, torch.bfloat16)


def trainable(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    # Tied parameters appear once, or their gradient would be packed (and clipped) twice; frozen ones never get grads.
    return [p for p in _unique(params) if p.requires_grad]


def _unique(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def group_size(group: dist.ProcessGroup | None) -> int:
    """The ranks in ``group``; None (no group) is this process alone."""
    return 1 if group is None else dist.get_world_size(group)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor made for a collective over ``group`` must live: NCCL takes CUDA tensors only."""
    if group is not None and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def used_somewhere(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> list[nn.Parameter]:
    """The ``params`` whose gradient is not None on at least one rank of ``group`` (one small all-reduce).

    As with DDP, a gradient that is None on every rank stays None, so optimizers skip the parameter (no momentum or
    weight decay from a made-up zero): a parameter frozen mid-run or one this step never used. Every rank of the
    group passes the same parameters in the same order. Whether a gradient is None is known on the host: on a gloo
    group the flags never leave the CPU, where on NCCL reading the result back would wait for all the GPU work
    queued before it (the whole backward), so the reductions pass a gloo ``vote_group`` over the same ranks.
    """
    if not params:
        return []
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    flags = flags.to(collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [p for p, used in zip(params, flags.tolist()) if used]


def voting_group(group: dist.ProcessGroup | None, vote_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group that votes on the gradients reduced over ``group``: ``vote_group`` (checked to hold the same ranks in
    the same order), or ``group`` itself."""
    if vote_group is None or vote_group is group or group is None:
        return group
    got, want = dist.get_process_group_ranks(vote_group), dist.get_process_group_ranks(group)
    if got != want:
        raise ValueError(f"vote_group must hold the ranks of the group it votes for, {want}, in order; got {got}")
    return vote_group


def _ensure_grad(p: nn.Parameter) -> torch.Tensor:
    # Another rank has a gradient for p: this one contributes zeros, so that every rank issues identical collectives.
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _by_dtype_device(params: Sequence[nn.Parameter]) -> dict[_Key, list[nn.Parameter]]:
    # Keyed on the parameter, not its grad: the grad may be None on this rank but not on its peers.
    groups: dict[_Key, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    return groups


def held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a split tensor's (DTensor's) local part, a view of it; else ``t``. Each rank of
    a dp group holds the same part of a tensor-parallel weight, so the parts are reduced as whole tensors are."""
    return t.to_local() if isinstance(t, DTensor) else t


def numel(p: torch.Tensor) -> int:
    return held(p).numel()


def _pack(params: Sequence[nn.Parameter], buffer: torch.Tensor) -> None:
    offset = 0
    for p in params:
        grad = held(_ensure_grad(p))
        n = grad.numel()
        buffer[offset : offset + n].view(grad.shape).copy_(grad)
        offset += n


def _unpack(params: Sequence[nn.Parameter], buffer: torch.Tensor) -> None:
    offset = 0
    for p in params:
        assert p.grad is not None, "packed, so it has a gradient"
        grad = held(p.grad)
        n = grad.numel()
        grad.copy_(buffer[offset : offset + n].view(grad.shape))
        offset += n


def sum_over_pipeline(
    params: Sequence[nn.Parameter], pp_group: dist.ProcessGroup | None, vote_group: dist.ProcessGroup | None = None
) -> None:
    """SUM the gradients of replicated ``params`` over ``pp_group``, one fused all-reduce per dtype and device.

    Every stage passes the same replicated parameters in the same order. A None grad counts as zeros (and is a tensor
    afterwards) where another stage has one; a grad that is None on every stage stays None: the stages agree on
    which over ``vote_group`` (a gloo group over the same ranks where ``pp_group`` is NCCL; default ``pp_group``),
    then sum over ``pp_group``. No-op if ``pp_group`` is None or has size 1.
    """
    if group_size(pp_group) == 1:
        return
    assert pp_group is not None
    votes = voting_group(pp_group, vote_group)
    assert votes is not None
    pending = []
    for (dtype, device), group in _by_dtype_device(used_somewhere(_unique(params), votes)).items():
        buffer = torch.empty(sum(numel(p) for p in group), dtype=dtype, device=device)
        _pack(group, buffer)
        pending.append((group, buffer, dist.all_reduce(buffer, group=pp_group, async_op=True)))
    for group, buffer, work in pending:
        work.wait()
        _unpack(group, buffer)


def launch_sum(buffer: torch.Tensor, dp_group: dist.ProcessGroup | None, hierarchy: Hierarchy | None) -> Any:
    """Start the SUM of ``buffer`` over the dp group: flat, or in ``hierarchy``'s steps; ``wait()`` finishes it."""
    if hierarchy is not None:
        return hierarchy.all_reduce(buffer)
    return dist.all_reduce(buffer, group=dp_group, async_op=True)


def launch_bucket(
    bucket: Sequence[nn.Parameter],
    buffer: torch.Tensor,
    world: int,
    dp_group: dist.ProcessGroup | None,
    hierarchy: Hierarchy | None,
) -> Any:
    """Pack ``bucket``'s gradients into ``buffer`` and start their sum over the ``world`` dp replicas, each share
    divided first in float16 and bfloat16 (then :meth:`PendingReduction.wait` does not divide): the only division,
    whether the sum is flat or in ``hierarchy``'s steps, which only add."""
    _pack(bucket, buffer)
    if buffer.dtype in _DIVIDED_FIRST:
        buffer.div_(world)
    return launch_sum(buffer, dp_group, hierarchy)


class BucketedAllReduce:
    """Averages gradients over the dp group in fused buckets (DDP's 25 MiB default; the Jizhi paper's tensor fusion
    threshold θ).

    Gradients are packed into flat buffers of at most ``bucket_bytes`` (a larger tensor gets a bucket of its own),
    grouped by dtype and device; each bucket is one asynchronous all-reduce(SUM), so the communication of one bucket
    overlaps the packing of the next, then divided by the dp size and unpacked (float16 and bfloat16 buckets are
    divided before the sum instead, as DDP does, so that the sum cannot overflow). As DDP does, only parameters with
    a gradient on some replica take part (see :func:`used_somewhere`): one that has none here gets a zero grad, one
    that has none anywhere (frozen, even mid-run, or unused this step) keeps None. The replicas agree on which over
    ``vote_group``, a gloo group over the ranks of ``dp_group`` where that one is NCCL, so that the host never waits
    for the GPU (default ``dp_group``). The flat buffers are allocated on the first call and reused; the plan is
    rebuilt when the set of parameters taking part, or a dtype or device, changes. Every replica must pass the same
    parameters in the same order: then each group sees the same collectives in the same order on every replica.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        hierarchy: Hierarchy | None = None,
        tail_bytes: int | None = None,
        vote_group: dist.ProcessGroup | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        # Not filtered by requires_grad: a parameter unfrozen after setup must still be averaged.
        self.params = _unique(params)
        self.dp_group, self.hierarchy = dp_group, hierarchy
        self.vote_group = voting_group(dp_group, vote_group)
        self.bucket_bytes, self.tail_bytes = bucket_bytes, tail_bytes
        self._plan_keys: list[tuple[int, torch.dtype, torch.device]] = []
        self.buckets: list[list[nn.Parameter]] = []
        self.buffers: list[torch.Tensor | None] = []
        self._plan(trainable(self.params))

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def _plan(self, params: list[nn.Parameter]) -> None:
        self._plan_keys = [(id(p), p.dtype, p.device) for p in params]
        self.buckets = []
        for group in _by_dtype_device(params).values():
            buckets = _fill(group, self.bucket_bytes)
            if self.tail_bytes is not None and self.tail_bytes < self.bucket_bytes:
                buckets += _fill(buckets.pop(), self.tail_bytes)
            self.buckets += buckets
        self.buffers = [None] * len(self.buckets)

    def buffer(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s flat buffer, allocated at its first use and kept for the next steps."""
        buffer = self.buffers[i]
        if buffer is None:
            first = self.buckets[i][0]
            size = sum(numel(p) for p in self.buckets[i])
            buffer = self.buffers[i] = torch.empty(size, dtype=first.dtype, device=first.device)
        return buffer

    def __call__(self) -> None:
        self.start().wait()

    def start(self) -> PendingReduction:
        """Agree on the parameters taking part, pack every bucket and launch its all-reduce; ``wait()`` on the
        result finishes the mean. Other collectives may run in between (on other groups: the gradients of these
        parameters must not change meanwhile)."""
        world = group_size(self.dp_group)
        if world == 1:
            return PendingReduction(world, [])
        assert self.vote_group is not None
        active = used_somewhere(self.params, self.vote_group)
        if [(id(p), p.dtype, p.device) for p in active] != self._plan_keys:
            self._plan(active)
        pending = []
        for i, bucket in enumerate(self.buckets):
            buffer = self.buffer(i)
            pending.append((bucket, buffer, launch_bucket(bucket, buffer, world, self.dp_group, self.hierarchy)))
        return PendingReduction(world, pending)


def _fill(params: list[nn.Parameter], cap: int) -> list[list[nn.Parameter]]:
    """``params`` in order, in buckets of at most ``cap`` bytes (a larger tensor gets a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = numel(p) * p.element_size()
        if bucket and size + nbytes > cap:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        buckets.append(bucket)
    return buckets


class PendingReduction:
    """The launched all-reduces of :meth:`BucketedAllReduce.start` (each from :func:`launch_bucket`), finished by
    :meth:`wait`."""

    def __init__(self, world: int, pending: list[tuple[list[nn.Parameter], torch.Tensor, Any]]) -> None:
        self.world, self.pending = world, pending

    def wait(self) -> None:
        """Wait for each bucket's sum, divide it by the dp size (unless :func:`launch_bucket` divided the shares) and
        copy it back into the gradients (once)."""
        pending, self.pending = self.pending, []
        for bucket, buffer, work in pending:
            work.wait()
            if buffer.dtype not in _DIVIDED_FIRST:
                # Gloo has no AVG, so divide after the sum (exact for power-of-two dp sizes).
                buffer.div_(self.world)
            _unpack(bucket, buffer)


class OverlappedReduction:
    """The dp mean of one stage's gradients, overlapped with the pipeline: the buckets of the stage's own parameters
    are launched as soon as its drain ends, before the sums over the stages holding a copy (pipeline collectives that
    wait for the slowest stage), which the buckets of the ``copied`` parameters must follow.

    ``params`` are the rank's parameters, ``copied`` those of them with a copy on another stage (replicated outside
    the backbone, tied across stages). The two sets are planned apart (each as :class:`BucketedAllReduce`), each in
    the order of ``params``, so that every replica of a stage launches the same collectives in the same order: the
    own flags (over ``vote_group``) and buckets, the caller's pipeline sums, the copied flags and buckets; each group
    (``vote_group``, ``dp_group``, the pipeline's) sees one sequence on all of its ranks. Each element's mean is the
    same as one reduction of all ``params`` gives: the same values summed over the same replicas (bit for bit with
    two replicas, where a sum has one order; with more, a backend may sum an element in an order that depends on its
    place in the bucket).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        copied: Sequence[nn.Parameter],
        dp_group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        hierarchy: Hierarchy | None = None,
        vote_group: dist.ProcessGroup | None = None,
    ) -> None:
        copied_ids = {id(p) for p in copied}
        params = _unique(params)
        own = [p for p in params if id(p) not in copied_ids]
        copied = [p for p in params if id(p) in copied_ids]
        self.own = BucketedAllReduce(own, dp_group, bucket_bytes, hierarchy, vote_group=vote_group)
        self.copied = BucketedAllReduce(copied, dp_group, bucket_bytes, hierarchy, vote_group=vote_group)

    @property
    def num_buckets(self) -> int:
        return self.own.num_buckets + self.copied.num_buckets

    def __call__(self, sum_copies: Callable[[], None]) -> None:
        """The whole reduction: :meth:`start`, then :meth:`finish`."""
        self.finish(self.start(), sum_copies)

    def start(self) -> PendingReduction:
        """Launch the own parameters' buckets (their gradients must be complete: the stage's drain is over)."""
        return self.own.start()

    def finish(self, own: PendingReduction, sum_copies: Callable[[], None]) -> None:
        """Run ``sum_copies`` (the pipeline sums of the copied gradients), launch the copied buckets, then finish
        both; ``own`` is what :meth:`start` returned."""
        sum_copies()
        copied = self.copied.start()
        own.wait()
        copied.wait()
