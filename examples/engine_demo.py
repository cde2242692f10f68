"""Two-stage CPU training run of the GPipe engine alone (no Lightning); launch with torchrun, prints a falling loss."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.pipe import GPipeStage

L, D, N, M, STEPS, EVERY = 8, 32, 64, 4, 300, 30


def make_backbone() -> nn.Sequential:
    """L residual-free MLP blocks; the same seed on every rank gives every stage the same initial weights."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.GELU()) for _ in range(L - 1)], nn.Linear(D, 10)
    )


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: the class is the argmax of a fixed random projection of the input."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(N, D, generator=g)
    teacher = torch.randn(D, 10, generator=torch.Generator().manual_seed(-1))
    return x, (x @ teacher).argmax(dim=1)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stage = GPipeStage(make_backbone(), chunks=M, balance="parameters", checkpoint="except_last")
    optimizer = torch.optim.Adam(stage.parameters(), lr=1e-2)
    if stage.is_last:
        print(f"K={stage.num_stages} stages, balance {stage.balance}, M={M} micro-batches of {N // M} samples")
    start, losses, hits = time.perf_counter(), [], []
    for step in range(STEPS):
        x, y = make_data(step)
        optimizer.zero_grad()
        logits = stage(x)  # stage 0 feeds x in; the last stage gets the joined logits back
        if stage.is_last:
            loss = F.cross_entropy(logits, y)
            loss.backward()
            losses.append(loss.item())
            hits.append((logits.argmax(1) == y).float().mean().item())
            if (step + 1) % EVERY == 0:
                mean_loss, accuracy = sum(losses[-EVERY:]) / EVERY, sum(hits[-EVERY:]) / EVERY
                print(
                    f"steps {step + 1 - EVERY:3d}-{step:3d}  loss {mean_loss:.4f}  accuracy {accuracy:.2f}", flush=True
                )
        stage.backward()
        optimizer.step()
    if stage.is_last:
        print(f"{STEPS} steps in {time.perf_counter() - start:.1f} s (rank {os.environ.get('RANK')})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
