"""Batch statistics over a data-parallel group: differentiable two-pass normalization and Chan's merge of replicas."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Moments", "all_reduce_sum", "check_same_m", "merge_moments", "sync_batch_norm"]

# Per-channel (count, mean, M2 = Σ(x − mean)²) of the samples seen, mean and M2 in float64.
Moments = tuple[int, torch.Tensor, torch.Tensor]


class _AllReduceSum(torch.autograd.Function):
    """torch.distributed.nn.functional.all_reduce(SUM) without its per-call deprecation warning.

    Every replica's output is the same sum, so the gradient of each input is the sum of the output gradients of all
    replicas: the backward is again an all-reduce, issued by every replica in its own backward.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group), None  # type: ignore[attr-defined]


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable SUM over ``group`` (gloo has no AVG); a collective on forward and on backward."""
    return _AllReduceSum.apply(tensor, group)


def sync_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalize ``input`` (N, C, *) with the batch statistics of the union of every replica's ``input``.

    Two collectives forward and up to two backward; every replica of ``group`` must call it at the same point.
    Replicas may hold different N: their true counts are summed. Returns the output and the (detached) global count,
    mean and biased variance per channel, in the statistics dtype (at least float32).
    """
    C = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, C] + [1] * (input.dim() - 2)
    # Half-precision sums of many values lose most of their digits: statistics in at least float32.
    x = input.to(torch.promote_types(input.dtype, torch.float32))
    # Count and sums share one collective; float32 counts are exact up to 2**24 values per channel.
    packed = all_reduce_sum(torch.cat([x.sum(dims), x.new_full((1,), x.numel() // max(C, 1))]), group)
    # No "more than 1 value per channel" check: every replica holds ≥ 1, so the union holds ≥ 2 (and the check would
    # cost a device sync).
    count = packed[C].detach()
    mean = packed[:C] / count
    centered = x - mean.view(shape)
    # Second pass around the global mean: E[x²] − E[x]² cancels catastrophically when |mean| ≫ std.
    var = all_reduce_sum(centered.square().sum(dims), group) / count
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    output = centered * scale.view(shape)
    if bias is not None:
        output = output + bias.view(shape)
    return output.to(input.dtype), count, mean.detach(), var.detach()


def merge_moments(moments: Sequence[Moments], group: dist.ProcessGroup) -> list[Moments]:
    """Each layer's moments merged over the replicas of ``group``, identical on every replica.

    One all_gather for all layers (not one per layer): a collective, so every replica passes the same layers in the
    same order. Uses the pairwise-merge form M2 = Σ_r M2_r + n_r (mean_r − mean)², exact in float64.
    """
    device = moments[0][1].device
    local = torch.cat([torch.cat([mean.new_tensor([count]), mean, m2]).to(device) for count, mean, m2 in moments])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered)  # (replicas, Σ_layers 1 + 2C)
    starts, offset = [], 0
    for _, mean, _ in moments:
        starts.append(offset)
        offset += 1 + 2 * mean.numel()
    totals = table[:, starts].sum(0).tolist()  # one device sync for all layers; float64 counts are exact integers
    merged: list[Moments] = []
    for start, total, (_, mean, _) in zip(starts, totals, moments):
        C = mean.numel()
        counts = table[:, start : start + 1]
        means, m2s = table[:, start + 1 : start + 1 + C], table[:, start + 1 + C : start + 1 + 2 * C]
        global_mean = (counts * means).sum(0) / max(total, 1.0)
        m2 = (m2s + counts * (means - global_mean).square()).sum(0)
        merged.append((round(total), global_mean.to(mean.device), m2.to(mean.device)))
    return merged


def check_same_m(M: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise on every replica of ``group`` unless all split their batch into the same M micro-batches."""
    mine = torch.tensor([M], device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    counts = [int(t.item()) for t in every]
    if len(set(counts)) > 1:
        raise ValueError(
            f"sync_batchnorm: the data-parallel replicas would split their batches into different numbers of "
            f"micro-batches (M = {counts}, one per replica), and synced BatchNorm needs the same M on every "
            "replica. A replica got fewer samples than chunks: give every replica the same batch size (Lightning's "
            "DistributedSampler does; drop_last=True avoids a short last batch), or lower chunks"
        )
