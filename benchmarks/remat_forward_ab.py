"""A/B: a checkpointed micro-batch's forward under ``no_grad`` vs in the recompute's grad mode with nothing saved."""

# rematerialize.first_forward takes the second on accelerators (the same kernels as the recompute) and the first on
# the CPU. This measures what the second would cost on the CPU: peers.py's model (8 Transformer encoder layers, d 256,
# batch 64 × 32), K = 2, M = 8, stage.train_step under each schedule, the two forwards alternating step by step in
# the same two processes. `python -m benchmarks.remat_forward_ab` (about 3 min on 2 cores); results in
# benchmarks/README.md.

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks.machine import launch, machine_info

STEPS, WARMUP = 14, 3


def run_job(rank: int, world: int, schedule: str) -> dict[str, list[float]]:
    import lightning_gpipe.pipe.schedule as schedule_module
    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.pipe.rematerialize import discarded_graph

    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True) for _ in range(8)]
    stage = GPipeStage(nn.Sequential(*layers), chunks=8, balance=[4, 4])
    x, y = torch.randn(64, 32, 256), torch.randn(64, 32, 256)
    sizes = stage.micro_batch_sizes(x)
    starts = [sum(sizes[:m]) for m in range(len(sizes))]

    def loss(out: torch.Tensor, m: int) -> torch.Tensor:
        target = y[starts[m] : starts[m] + sizes[m]]
        return nn.functional.mse_loss(out, target, reduction="sum") / y.numel()

    forwards: dict[str, Any] = {
        "no_grad": lambda device: torch.no_grad(),
        "grad mode, nothing saved": lambda device: discarded_graph(),
    }
    times: dict[str, list[float]] = {name: [] for name in forwards}
    for step in range(STEPS):
        for name, forward in forwards.items():
            schedule_module.first_forward = forward  # type: ignore[assignment]
            start = time.perf_counter()
            stage.train_step(x, loss, schedule=schedule)  # type: ignore[arg-type]
            if step >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    print(machine_info())
    for schedule in ("gpipe", "1f1b"):
        times = launch(run_job, 2, schedule)  # rank 0: stage 0, the one that recomputes
        before, now = times["no_grad"], times["grad mode, nothing saved"]
        paired = statistics.median(n / b for b, n in zip(before, now))
        print(
            f"{schedule}: median step {statistics.median(before) * 1e3:.0f} ms (no_grad), "
            f"{statistics.median(now) * 1e3:.0f} ms (grad mode, nothing saved); median of the {len(now)} paired "
            f"step ratios {paired:.3f}"
        )


if __name__ == "__main__":
    main()
