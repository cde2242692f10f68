"""The plain single-process reference for test_loops: what each Lightning-loop scenario must equal, in torch alone."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_gpipe.pipe import micro_batch_sizes
from tests.helpers import models
from tests.helpers.tiny_fit import BATCH, LR, Net, dataset

PP = 2
CHUNKS = 3
EVAL_SAMPLES = 20  # batches of 6, 6, 6, 2: the last one runs fewer micro-batches than CHUNKS
BN_LAYERS = (1, 4)  # models.with_bn(): Linear, BN, Tanh, Linear, BN, Tanh


@dataclass(frozen=True)
class Case:
    name: str
    batches: int = 6  # training batches (limit_train_batches, one epoch)
    batch: int = BATCH
    accumulate: int = 1  # accumulate_grad_batches, or the manual accumulation window
    clip: float | None = None
    clip_algorithm: str = "norm"
    scheduler: bool = False  # StepLR(step_size=1, gamma=0.5), stepped every optimizer step
    manual: str | None = None  # None (automatic), "plain" or "accumulate"
    bn: bool = False
    evaluate: bool = False  # a validation loader in fit, then validate, test and predict
    val_check_interval: int | None = None
    checkpoint: bool = False  # ModelCheckpoint(monitor="train_loss", save_top_k=1) every step
    sync_bn: bool = False  # Trainer(sync_batchnorm=True): micro-batch m normalized over all replicas' m-th ones
    data_parallel: str = "ddp"  # GPipeStrategy(data_parallel=...): "fsdp" shards each stage over its replicas


class BNNet(nn.Module):
    """Test_strategy's Net with BatchNorm in the backbone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.prefix = nn.Linear(models.D, models.D)
        self.backbone = models.with_bn()
        self.head = nn.Linear(models.D, models.D)
        # Not the default 1 and 0: a bias that starts at 0 and moves by 1e-3 would be compared at the ulp level.
        for i in BN_LAYERS:
            nn.init.uniform_(self.backbone[i].weight, 0.5, 1.5)
            nn.init.uniform_(self.backbone[i].bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.prefix(x)))


def make_net(bn: bool) -> nn.Module:
    return BNNet() if bn else Net()


def eval_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(EVAL_SAMPLES, models.D, generator=g), torch.randn(EVAL_SAMPLES, models.D, generator=g)
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative to ``b``'s largest magnitude; a shard (``data_parallel="fsdp"``) gathered whole first (collective)."""
    a = a.full_tensor() if isinstance(a, DTensor) else a
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ------------------------------------------------------------------------------------------------- the reference
@contextlib.contextmanager
def _whole_batch_statistics(net: nn.Module, full_bn: dict[int, nn.Module]) -> Iterator[None]:
    """Collects what each BatchNorm of ``net`` sees inside the block, then runs ``full_bn``'s copies on all of it."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in full_bn}
    hooks = [
        net.backbone[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0].detach()))
        for i, got in seen.items()
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, bn in full_bn.items():
            bn(torch.cat(seen[i]))


def _per_micro_batch(net: nn.Module, x: torch.Tensor, full_bn: dict[int, nn.Module]) -> torch.Tensor:
    """What GPipe computes: each micro-batch through the plain model alone (BatchNorm with micro-batch statistics).

    ``full_bn`` (copies of the BatchNorm layers) sees each BatchNorm's whole mini-batch input at once: its running
    statistics are what deferred BatchNorm must end with.
    """
    with _whole_batch_statistics(net, full_bn):
        return torch.cat([net(mb) for mb in x.split(micro_batch_sizes(len(x), CHUNKS))])


def reference(case: Case, dp: int) -> dict[str, Any]:
    """Plain torch: per optimizer step, the mean over dp replicas × accumulation window of the batches' gradients."""
    net = make_net(case.bn)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.scheduler else None
    full_bn = {i: copy.deepcopy(net.backbone[i]) for i in BN_LAYERS} if case.bn else {}
    x_all, y_all = dataset().tensors
    # Lightning shuffles a training loader's injected DistributedSampler (seed 0, epoch 0).
    shards = [torch.tensor(list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0))) for d in range(dp)]
    losses: list[list[float]] = [[] for _ in range(dp)]
    clipped = False
    for b in range(case.batches):
        if b % case.accumulate == 0:
            opt.zero_grad()
        batches = [shard[b * case.batch : (b + 1) * case.batch] for shard in shards]
        outs = _synced_micro_batches(net, [x_all[i] for i in batches], full_bn) if case.sync_bn else None
        for d, idx in enumerate(batches):
            x, y = x_all[idx], y_all[idx]
            if outs is None:
                outs_d = _per_micro_batch(net, x, full_bn) if case.bn else net(x)
            out = outs[d] if outs is not None else outs_d
            loss = F.mse_loss(out, y)
            (loss / (dp * case.accumulate)).backward(retain_graph=outs is not None)
            losses[d].append(loss.item())
        if (b + 1) % case.accumulate and b != case.batches - 1:
            continue
        if case.clip and case.clip_algorithm == "norm":
            clipped |= bool(torch.nn.utils.clip_grad_norm_(net.parameters(), case.clip) > case.clip)
        elif case.clip:
            clipped |= max(p.grad.abs().max().item() for p in net.parameters()) > case.clip
            torch.nn.utils.clip_grad_value_(net.parameters(), case.clip)
        opt.step()
        if sched is not None:
            sched.step()
    for i, bn in full_bn.items():  # the plain model, evaluated, normalizes with the whole mini-batches' statistics
        for name, buffer in bn.named_buffers():  # (its weight and bias are the trained ones, not bn's)
            net.backbone[i].get_buffer(name).copy_(buffer)
    buffers = {f"backbone.{i}.{k}": v.clone() for i, bn in full_bn.items() for k, v in bn.named_buffers()}
    return {
        "net": net,
        "params": {k: v.detach().clone() for k, v in net.named_parameters()},
        "buffers": buffers,
        "losses": losses,
        "lr": opt.param_groups[0]["lr"],
        "clipped": clipped,
    }


def reference_evaluation(net: nn.Module) -> dict[str, Any]:
    """The plain model on the evaluation set. The logged val_loss (a batch-size weighted mean of per-batch means, over
    the replicas' shards with sync_dist) and the MeanSquaredError both come to the MSE of the whole set."""
    net.eval()
    x_all, y_all = eval_dataset().tensors
    with torch.no_grad():
        out = net(x_all)
    return {"mse": F.mse_loss(out, y_all).item(), "predictions": out}


def _synced_micro_batches(net: nn.Module, xs: list[torch.Tensor], full_bn: dict[int, nn.Module]) -> list[torch.Tensor]:
    """What synchronized BatchNorm computes: micro-batch m of every replica through the plain model together (one
    set of statistics over all replicas' m-th micro-batches); ``full_bn`` sees the whole global mini-batch."""
    pieces = [x.split(micro_batch_sizes(len(x), CHUNKS)) for x in xs]
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    with _whole_batch_statistics(net, full_bn):
        for m in range(len(pieces[0])):
            joint = net(torch.cat([p[m] for p in pieces]))
            for d, out in enumerate(joint.split([p[m].shape[0] for p in pieces])):
                outs[d].append(out)
    return [torch.cat(o) for o in outs]
