"""Trainer(profiler="pytorch") sees the pipeline schedule: each stage's forward, recompute and backward of each
micro-batch as a named ``record_function`` range in torch's trace."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_gpipe.pipe.trace.events import profiler_range, range_name
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

M = 3
RANGE = re.compile(r"gpipe stage (\d+): (\w[\w-]*)(?: (\d+))?")


def test_a_range_only_while_the_profiler_runs() -> None:
    assert isinstance(profiler_range(0, "forward", 1), type(profiler_range(0, "status")))  # both a no-op now
    with torch.profiler.profile() as prof:
        with profiler_range(1, "backward", 2):
            torch.ones(2).sum()
        with profiler_range(0, "step", label="forward"):
            pass
    names = [e.name for e in prof.events()]
    assert "gpipe stage 1: backward 2" in names and "gpipe stage 0: step (forward)" in names, names
    assert range_name(3, "recv-wait", 0) == "gpipe stage 3: recv-wait 0"


def profiled_fit_worker(rank: int, world_size: int, out: str, hooked: bool) -> None:
    from lightning.pytorch.profilers import PyTorchProfiler

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(chunks=M, pipeline_parallel_size=2)
    profiler = PyTorchProfiler(dirpath=out, filename=f"rank{rank}", export_to_chrome=True)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=4, profiler=profiler)
    trainer.fit(lightning_module(hooked=hooked), DataLoader(dataset(), batch_size=BATCH))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hooked", [False, True], ids=["loss between the phases", "loss inside the pipeline"])
def test_torch_profiler_shows_every_micro_batch_of_every_stage(tmp_path: Path, hooked: bool) -> None:
    run_distributed(profiled_fit_worker, 2, str(tmp_path), hooked, timeout=220, lightning=True)
    for k in (0, 1):
        traces = sorted(tmp_path.glob(f"*rank{k}*.json"))
        assert traces, sorted(p.name for p in tmp_path.iterdir())
        ranges: Counter[tuple[int, str, int]] = Counter()
        for trace in traces:
            for event in json.loads(trace.read_text())["traceEvents"]:
                found = RANGE.fullmatch(event.get("name", ""))
                if found and event.get("ph") == "X":
                    ranges[(int(found[1]), found[2], int(found[3] or -1))] += 1
        assert {stage for stage, _, _ in ranges} == {k}, ranges  # each process names its own stage
        # Lightning's profiler schedule (wait, warm-up, active) records some of the 4 steps, counted per action
        # (training_step, backward): each kind has every micro-batch alike, not each kind as many steps.
        # Re-materialization ("except_last"): a micro-batch whose backward is the stage's next op keeps its graph:
        # the last one of the whole-batch path's fill; with the loss inside, every one on the last stage (its
        # backward follows its forward) and none on stage 0 (its backwards start after all its forwards).
        recomputed = range(M - 1) if not hooked else range(M) if k == 0 else range(0)
        for kind, expected in (("forward", range(M)), ("backward", range(M)), ("recompute", recomputed)):
            counts = {m: ranges[(k, kind, m)] for m in range(M) if ranges[(k, kind, m)]}
            assert set(counts) == set(expected) and len(set(counts.values())) <= 1, (kind, ranges)
        if k == 1 and hooked:  # the loss inside the pipeline: one range per micro-batch on the last stage
            assert {m for m in range(M) if ranges[(1, "loss", m)]} == set(range(M)), ranges
