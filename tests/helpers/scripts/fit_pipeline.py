"""Fit a tiny pipelined model; run by tests under torchrun and under Lightning's own launcher."""

from __future__ import annotations

import atexit
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer
from tests.helpers.tiny_fit import BATCH, N_SAMPLES, STEPS, dataset, lightning_module, reference


def main(out: str, num_nodes: int = 1, devices: int = 2, K: int | None = None, dp_reduction: str = "auto") -> None:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = lightning_module()
    dp = num_nodes * devices // (K or num_nodes * devices)
    steps = min(STEPS, N_SAMPLES // (dp * BATCH))  # within the first epoch (the reference does not reshuffle)
    # Registered before fit, so it runs after the strategy's own exit handler (atexit runs last-in, first-out).
    atexit.register(lambda: Path(f"{out}.{trainer.global_rank}.exit").write_text(str(dist.is_initialized())))
    trainer = quiet_trainer(
        devices=devices,
        num_nodes=num_nodes,
        strategy=GPipeStrategy(
            chunks=3,
            timeout=timedelta(seconds=60),
            pipeline_parallel_size=K or "auto",
            data_parallel_reduction=dp_reduction,  # type: ignore[arg-type]
        ),
        max_steps=steps,
    )
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(dp, None, steps=steps)
    err = max(((p - expected[n]).abs().max() / expected[n].abs().max()).item() for n, p in module.named_parameters())
    result = {
        "rank": trainer.global_rank,
        "err": err,
        "stage": trainer.strategy.stage.index,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "threads": torch.get_num_threads(),
        "hierarchical": trainer.strategy._mesh.dp_hierarchy is not None,
    }
    Path(f"{out}.{trainer.global_rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    args = sys.argv[2:]
    main(sys.argv[1], *map(int, args[:3]), *args[3:])
