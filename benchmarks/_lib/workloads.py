"""The models, batches, losses and steps several benchmarks share: GPipe's two paper models, and an encoder stack."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.models import amoebanet_d, transformer_nmt
from lightning_gpipe.pipe import GPipeStage, solve
from lightning_gpipe.pipe.split.balance import costs_by_time, resolve_balance
from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages
from lightning_gpipe.pipe.state.batchnorm import convert_deferred_batch_norm, deferred_statistics

SEED, PAD, BOS = 0, 0, 1

# ------------------------------------------------------ the paper's models (throughput.py, overhead.py)
# Global batch 64 (divisible by M = 32); one K=1, M=1 step takes about 0.3–0.7 s on one core.
SIZES: dict[str, dict[str, Any]] = {
    "amoebanet": {"num_layers": 9, "num_filters": 48, "num_classes": 10, "side": 32, "batch": 64},
    "transformer": {"L": 6, "H": 512, "A": 4, "d_model": 128, "vocab": 4000, "seq": 32, "batch": 64},
}
SMOKE_SIZES: dict[str, dict[str, Any]] = {
    "amoebanet": {"num_layers": 3, "num_filters": 8, "num_classes": 10, "side": 32, "batch": 16},
    "transformer": {"L": 1, "H": 64, "A": 2, "d_model": 32, "vocab": 100, "seq": 8, "batch": 16},
}

# GPipe (Huang et al., 2019) Table 2: throughput normalized to K=2, M=1 ({M: {K: value}}).
PAPER_TABLE2 = {
    "amoebanet": {1: {2: 1.0, 4: 1.13, 8: 1.38}, 4: {2: 1.07, 4: 1.26, 8: 1.72}, 32: {2: 1.21, 4: 1.84, 8: 3.48}},
    "transformer": {1: {2: 1.0, 4: 1.07, 8: 1.3}, 4: {2: 1.7, 4: 3.2, 8: 4.8}, 32: {2: 1.8, 4: 3.4, 8: 6.3}},
}


def resized(sizes: dict[str, dict[str, Any]], changes: list[str]) -> dict[str, dict[str, Any]]:
    """``sizes`` with the benchmarks' ``--set KEY=INT`` changes, each applied to the models that have the key."""
    values = {key: int(value) for key, value in (item.split("=", 1) for item in changes)}
    return {name: s | {key: v for key, v in values.items() if key in s} for name, s in sizes.items()}


def describe(name: str, s: dict[str, Any]) -> str:
    if name == "amoebanet":
        return (
            f"AmoebaNet-D(L={s['num_layers']}, D={s['num_filters']}), {s['num_classes']} classes, "
            f"batch {s['batch']}×3×{s['side']}×{s['side']}"
        )
    return (
        f"Transformer T(L={s['L']}, H={s['H']}, A={s['A']}), d_model={s['d_model']}, vocab {s['vocab']}, "
        f"batch {s['batch']} × {s['seq']} source + {s['seq']} target tokens; head (vocabulary projection) = "
        "the backbone's last layer"
    )


def build(name: str, s: dict[str, Any]) -> nn.Sequential:
    torch.manual_seed(SEED)
    if name == "amoebanet":
        return amoebanet_d(num_classes=s["num_classes"], num_layers=s["num_layers"], num_filters=s["num_filters"])
    return transformer_nmt(s["L"], s["H"], s["A"], d_model=s["d_model"], vocab_size=s["vocab"], dropout=0.0)


def make_batch(name: str, s: dict[str, Any], n: int | None = None) -> tuple[Any, torch.Tensor]:
    """(input, target) of ``n`` samples (default: the global batch), the same on every rank."""
    n = n or s["batch"]
    g = torch.Generator().manual_seed(SEED + 1)
    if name == "amoebanet":
        x = torch.randn(n, 3, s["side"], s["side"], generator=g)
        return x, torch.randint(0, s["num_classes"], (n,), generator=g)
    src = torch.randint(BOS + 1, s["vocab"], (n, s["seq"]), generator=g)
    tgt = torch.randint(BOS + 1, s["vocab"], (n, s["seq"] + 1), generator=g)
    tgt[:, 0] = BOS
    return (src, tgt[:, :-1]), tgt[:, 1:]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # the Transformer's logits [N, T, V]
        return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=PAD)
    return F.cross_entropy(out, target)


def per_micro_batch(
    loss: Callable[[Any, torch.Tensor], torch.Tensor], target: torch.Tensor, sizes: list[int]
) -> Callable[[Any, int], torch.Tensor]:
    """``GPipeStage.forward_backward``'s loss_fn: micro-batch m's loss weighted n_m / N, so the M terms add up to the
    whole batch's mean (exact for a mean over samples, and for the token means here: no target token is padding)."""
    targets, total = target.split(sizes), sum(sizes)
    return lambda y, m: loss(y, targets[m]) * (sizes[m] / total)


def micro_batch_step(name: str, s: dict[str, Any], M: int) -> Callable[[], None]:
    """Forward, loss and backward of one micro-batch through the whole model, BatchNorm deferred as in a stage."""
    model = convert_deferred_batch_norm(build(name, s))
    x, target = make_batch(name, s, s["batch"] // M)

    def step() -> None:
        with deferred_statistics():
            loss_fn(model(x), target).backward()

    return step


def balances(name: str, s: dict[str, Any], ks: list[int], how: str, loss_inside: int | None = None) -> dict[str, Any]:
    """Layer counts per K: 'time' profiles every layer once (on batch/8 samples) and solves each K exactly; with
    ``loss_inside`` = M, for the shortest simulated GPipe step of M micro-batches with the loss inside the pipeline
    (as GPipeStrategy cuts then: ``chunks.solve_virtual_stages``), else for the cheapest costliest stage (``solve``)."""
    model = build(name, s)
    info: dict[str, Any] = {
        "model": describe(name, s),
        "sizes": s,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": list(model._modules),
        "balance_by": how,
    }
    if how == "time":
        x, _ = make_batch(name, s, max(s["batch"] // 8, 1))
        costs = costs_by_time(model, x, repeat=5)
        info["layer_costs_ms"] = [c * 1e3 for c in costs]
        if loss_inside is None:
            info["balance"] = {k: solve(costs, k) for k in ks}
        else:
            info["balance"] = {k: solve_virtual_stages(costs, k, 1, loss_inside, "except_last", "gpipe") for k in ks}
        info["cut"] = "cheapest costliest stage" if loss_inside is None else "shortest simulated gpipe step"
    else:
        info["balance"] = {k: resolve_balance(model, k, "parameters") for k in ks}
    return info


# ------------------------------------ the encoder stack (peers.py, peers_variable.py, studies/engine_speed.py)
# Module globals, read when called: ``configure`` changes them (the small --smoke shape below).
LAYERS, D_MODEL, HEADS, FFN = 8, 256, 8, 1024
BATCH, SEQ = 64, 32
# A small stack for --smoke runs (peers.py, studies/engine_speed.py).
SMOKE_ENCODER = {"LAYERS": 4, "D_MODEL": 64, "HEADS": 4, "FFN": 256, "BATCH": 16, "SEQ": 16}


def configure(shape: dict) -> None:
    """Set the encoder stack's sizes (LAYERS, D_MODEL, HEADS, FFN, BATCH, SEQ), which the functions below read."""
    globals().update(shape)


def build_encoder() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FFN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        ]
    )


def encoder_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(BATCH, SEQ, D_MODEL, generator=g), torch.randn(BATCH, SEQ, D_MODEL, generator=g)


class CheckpointedStage(nn.Module):
    """torch's stage module: its layers re-materialized in the backward pass by torch.utils.checkpoint.

    ``stage`` checkpoints the layers as one call, so a stage keeps only its input per micro-batch, as ours does for a
    checkpointed micro-batch; ``layer`` checkpoints each layer (more saved inputs, same compute); ``none`` runs the
    layers plainly (every activation kept, as ours under ``checkpoint="never"``).
    """

    def __init__(self, layers: list[nn.Module], mode: str) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.mode == "none":
            return self.layers(x)
        if self.mode == "stage":
            return checkpoint(self.layers, x, use_reentrant=False)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def build_torch(
    model: nn.Sequential, rank: int, M: int, group: Any, mode: str, schedule: str = "gpipe"
) -> tuple[Any, nn.Module]:
    """torch's K=2 pipeline of the encoder stack on this rank: ``ScheduleGPipe`` or (``"1f1b"``) ``Schedule1F1B``."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    half = LAYERS // 2
    module = CheckpointedStage(list(copy.deepcopy(model))[rank * half : (rank + 1) * half], mode)
    stage = TorchStage(module, rank, 2, torch.device("cpu"), group=group)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(stage, n_microbatches=M, loss_fn=F.mse_loss), module


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


# One step, forward + loss + backward, of ours, of the plain model, of torch's schedule.
def ours_step(stage: GPipeStage, x: torch.Tensor, y: torch.Tensor) -> float | None:
    out = stage(x if stage.is_first else None)
    loss = None
    if stage.is_last:
        loss = F.mse_loss(out, y)
        loss.backward()
    stage.backward()
    return None if loss is None else loss.item()


def ours_forward_backward(stage: GPipeStage, x: torch.Tensor, y: torch.Tensor, schedule: str) -> float | None:
    """``stage.forward_backward``: the MSE per micro-batch on the last stage (weighted n_m/N), GPipe or 1F1B."""
    per_micro = per_micro_batch(F.mse_loss, y, stage.micro_batch_sizes(x))
    losses = stage.forward_backward(x if stage.is_first else None, per_micro, schedule=schedule)  # type: ignore[arg-type]
    return torch.stack(losses).sum().item() if stage.is_last else None


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


def torch_step(schedule: Any, is_last: bool, x: torch.Tensor, y: torch.Tensor) -> float | None:
    if is_last:
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses, return_outputs=False)
        # Per-micro-batch MSE means over equal micro-batches: their mean is the full-batch MSE.
        return torch.stack([loss.detach() for loss in losses]).mean().item()
    schedule.step(x, return_outputs=False)
    return None
