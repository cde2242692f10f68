"""Lightning's collectives under GPipeStrategy at pp = 2 × dp = 2, as DDP over the replicas would give them:
``all_gather`` and ``reduce`` (``sync_dist``) over the replicas of a stage, ``broadcast``, ``barrier`` and
``reduce_boolean_decision`` over every rank."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyPipelined, dataset


class Gathering(TinyPipelined):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            rank = self.global_rank
            self.seen["gathered"] = self.all_gather(torch.tensor([float(rank)])).flatten().tolist()
            self.seen["samples"] = float(self.all_gather(torch.tensor(float(len(batch[0])))).sum())
            self.seen["reduced"] = float(self.trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum"))
            self.seen["broadcast"] = self.trainer.strategy.broadcast(rank)
            self.trainer.strategy.barrier()
            self.seen["vote"] = self.trainer.strategy.reduce_boolean_decision(rank == 3, all=False)
        return super().training_step(batch, batch_idx)


def worker(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Gathering()
    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=2, backbone="backbone")
    quiet_trainer(devices=world_size, strategy=strategy, max_steps=2).fit(
        module, DataLoader(dataset(), batch_size=BATCH)
    )
    return module.seen


@pytest.mark.timeout(300)
def test_collectives_follow_ddp_over_the_replicas() -> None:
    for rank, seen in enumerate(run_distributed(worker, 4, timeout=200, lightning=True)):
        k = rank % 2  # stage k of replica rank // 2
        assert seen["gathered"] == [float(k), float(2 + k)], (rank, seen)  # one entry per replica, not per rank
        assert seen["samples"] == 2 * BATCH, (rank, seen)  # the samples of one step, counted once
        assert seen["reduced"] == 2.0, (rank, seen)
        assert seen["broadcast"] == 0 and seen["vote"] is True, (rank, seen)
