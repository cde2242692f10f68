"""Host reads of tensor values per training step do not grow with M (on GPUs each is a device-to-host sync).

A TorchFunctionMode counts every call that hands a tensor's value to Python (``item``, ``tolist``, ``float``, …)
during a loss-inside training step that logs inside ``pipeline_loss``, at M = 2 and M = 6. The transport's header
parsing and torch's object collectives are left out: headers and payloads live on the CPU group by design, on any
backend. ``tests.gpu_matrix`` checks the same on a GPU with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import collections
import os
import traceback
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import Logged, dataset

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}
CPU_BY_DESIGN = {"transport.py", "distributed_c10d.py"}


class CountReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            caller = traceback.extract_stack(limit=2)[0]
            if os.path.basename(caller.filename) not in CPU_BY_DESIGN:
                self.reads[f"{func.__name__} at {os.path.basename(caller.filename)}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))


class CountPerStep(pl.Callback):
    def __init__(self) -> None:
        self.modes: list[CountReads] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.modes.append(CountReads())
        self.modes[-1].__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self.modes[-1].__exit__(None, None, None)


def worker(rank: int, world_size: int, M: int) -> dict[str, int]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    counter = CountPerStep()
    strategy = GPipeStrategy(chunks=M, pipeline_parallel_size=2, backbone="backbone")
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=3, callbacks=[counter])
    trainer.fit(Logged(), DataLoader(dataset(), batch_size=12))
    return dict(counter.modes[-1].reads)  # a step after the first: the per-epoch checks are behind it


@pytest.mark.timeout(300)
def test_host_reads_per_step_do_not_grow_with_M() -> None:
    few, many = (run_distributed(worker, 2, M, timeout=200, lightning=True) for M in (2, 6))
    for rank in range(2):
        assert sum(few[rank].values()) > 0, few  # the counter sees the reads there are
        assert few[rank] == many[rank], (rank, few[rank], many[rank])
