"""GPipeStrategy at pp = 2 × dp = 2: a stage's own gradients are reduced over the replicas while stage 0 still drains,
and the run stays the same as a plain one."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, STEPS, TOL, dataset, lightning_module, reference

SLOW_S = 1.0  # stage 0's drain made this much longer than the last stage's (a margin for a loaded machine)


def overlap_worker(rank: int, world_size: int, hooked: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    drain_ends: list[int] = []
    launches: list[tuple[int, tuple[int, ...], str]] = []
    drain, launch = GPipeStage.backward, dist.all_reduce

    def slow_drain(self: GPipeStage, *args: Any, drained: Any = None, **kwargs: Any) -> None:
        if self.is_first:  # a slow first stage: the last one ends its drain well before
            time.sleep(SLOW_S)

        def timed() -> None:
            drain_ends.append(time.perf_counter_ns())  # one clock for every process on this host
            if drained is not None:
                drained()

        drain(self, *args, drained=timed, **kwargs)

    def logged(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        launches.append((time.perf_counter_ns(), ranks, str(tensor.dtype)))
        return launch(tensor, *args, group=group, **kwargs)

    forward_backward = GPipeStage.forward_backward

    def slow_step(self: GPipeStage, *args: Any, drained: Any = None, **kwargs: Any) -> Any:
        def timed() -> None:  # the loss inside the pipeline: stage 0's last backward made slow
            if self.is_first:
                time.sleep(SLOW_S)
            drain_ends.append(time.perf_counter_ns())
            if drained is not None:
                drained()

        return forward_backward(self, *args, drained=timed, **kwargs)

    GPipeStage.backward = slow_drain  # type: ignore[method-assign]
    GPipeStage.forward_backward = slow_step  # type: ignore[method-assign]
    dist.all_reduce = logged
    module = lightning_module(hooked=hooked)
    starts: list[int] = []

    class Starts(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.perf_counter_ns())

    strategy = GPipeStrategy(chunks=3, pipeline_parallel_size=2)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS, callbacks=[Starts()])
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    dist.all_reduce = launch
    expected = reference(2, None)
    error = max(
        ((p.detach().cpu() - expected[n]).abs().max() / expected[n].abs().max()).item()
        for n, p in module.named_parameters()
    )
    replicas = (rank % 2, rank % 2 + 2)
    # The first float all-reduce over this stage's replicas in each step: its first gradient bucket, which with the
    # loss inside the pipeline leaves during the stage's last backward op.
    first_bucket = [
        next(t for t, ranks, dtype in launches if t > start and ranks == replicas and dtype == "torch.float32")
        for start in starts
    ]
    return {"drain_ends": drain_ends, "first_bucket": first_bucket, "error": error}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hooked", [False, True], ids=["loss between the phases", "loss inside the pipeline"])
def test_last_stage_reduces_its_own_gradients_while_stage_0_drains(hooked: bool) -> None:
    results = run_distributed(overlap_worker, 4, hooked, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["error"] <= TOL, (rank, r["error"])
        assert len(r["drain_ends"]) == STEPS, (rank, r)
    for last, first in ((1, 0), (3, 2)):  # the last stage of each replica, and that replica's stage 0
        for step in range(STEPS):
            launched, stage0_done = results[last]["first_bucket"][step], results[first]["drain_ends"][step]
            # Waiting on the pipeline first (the drain's status check, the pipeline sums of the replicated head and
            # prefix) would launch it only after stage 0's drain.
            assert launched < stage0_done - SLOW_S / 2 * 1e9, (step, (stage0_done - launched) / 1e9)
