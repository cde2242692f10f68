"""GPipeStrategy(schedule="interleaved-1f1b", virtual_stages=v): the plain Trainer's run, its checkpoint, its errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.strategy._balance import Plan
from lightning_gpipe.strategy._partition_report import PartitionReport, WholeModel
from tests.helpers.launch import run_distributed
from tests.helpers.pipeline_loss_fit import LOGGED, HookModule, fit
from tests.helpers.tiny_fit import TOL


class TiedHook(HookModule):
    """HookModule whose head is tied to its prefix (both outside the backbone, a copy on every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.prefix.weight


def worker(
    rank: int,
    world_size: int,
    pp: int,
    v: int,
    accumulate: int,
    clip: float | None,
    tied: bool,
    out: str,
    schedule: str = "interleaved-1f1b",
) -> dict[str, Any]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(
        chunks=4,
        pipeline_parallel_size=pp,
        schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=v,
        save_distributed_checkpoint=False,
    )
    module, metrics = fit(strategy, world_size, 1, accumulate, clip, TiedHook if tied else HookModule)
    trainer = module.trainer
    trainer.save_checkpoint(f"{out}/last.ckpt")
    stage = strategy.stage
    return {
        "params": {n: p.detach().tolist() for n, p in module.named_parameters()},
        "metrics": metrics,
        "ranges": [list(r) for r in stage.layer_ranges],
        "balance": stage.balance,
        "saved": sorted(torch.load(f"{out}/last.ckpt", weights_only=False)["state_dict"]) if rank == 0 else None,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "pp", "v", "accumulate", "clip", "tied", "schedule"),
    [
        (2, 2, 2, 2, 0.05, False, "interleaved-1f1b"),
        (4, 2, 2, 1, 0.05, True, "interleaved-1f1b"),
        (3, 3, 2, 1, None, False, "interleaved-1f1b"),
        (4, 2, 2, 1, 0.05, True, "interleaved-zb"),  # each backward split, the weight gradients deferred
        (3, 3, 2, 2, None, False, "interleaved-zb"),
        (4, 2, 2, 1, 0.05, True, "zb-v"),  # two chunks per rank in a V: the loss and the head on rank 0
        (3, 3, 2, 2, None, False, "zb-v"),
    ],
)
def test_interleaved_fit_is_the_plain_run(
    world_size: int, pp: int, v: int, accumulate: int, clip: float | None, tied: bool, schedule: str, tmp_path: Any
) -> None:
    """Weights equal the plain Trainer's (≤ 1e-6) with accumulation and clipping, pp × dp (the ready buckets leave
    during the last backward), a prefix tied to the head; every logged value on dp = 1; each rank holds two chunks of
    the 2K (the backbone's 8 layers solved for 2K parts; k, k + K interleaved, k and 2K − 1 − k in ZB-V's V, where
    rank 0 holds the last stage), and the checkpoint file holds exactly the plain module's keys."""
    dp = world_size // pp
    args = (pp, v, accumulate, clip, tied, str(tmp_path), schedule)
    results = run_distributed(worker, world_size, *args, timeout=280, lightning=True)
    warnings.simplefilter("ignore")
    plain, plain_metrics = fit("auto", 1, dp, accumulate, clip, TiedHook if tied else HookModule)
    expected = dict(plain.named_parameters())
    for rank, r in enumerate(results):
        assert len(r["balance"]) == pp * v and sum(r["balance"]) == 8, (rank, r["balance"])
        assert len(r["ranges"]) == v and len(r["params"]) > 4, rank
        for name, value in r["params"].items():
            ref = expected[name].detach().cpu()
            err = ((torch.tensor(value) - ref).abs().max() / ref.abs().max()).item()
            assert err <= TOL, (rank, name, err)
        if dp == 1:
            for key in (*LOGGED, "train_mse_epoch"):
                got, want = r["metrics"][key], plain_metrics[key]
                assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, key, got, want)
    held = sorted(i for r in results[:pp] for rng in r["ranges"] for i in rng)
    assert held == list(range(8))
    assert results[0]["saved"] == sorted(plain.state_dict())


def refused_worker(rank: int, world_size: int, chunks: int) -> str:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(chunks=chunks, schedule="interleaved-1f1b", virtual_stages=2)
    try:
        fit(strategy, world_size, 1, 1, None)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_chunks_the_interleaved_schedule_refuses_fail_at_setup_on_every_rank() -> None:
    for rank, text in enumerate(run_distributed(refused_worker, 2, 5, timeout=100, lightning=True)):
        assert text.startswith("GPipeStrategy(chunks=5) on 2 pipeline stages: schedule 'interleaved-1f1b' runs"), (
            rank,
            text,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"virtual_stages": 2}, "GPipeStrategy(schedule='gpipe', virtual_stages=2): 'gpipe' runs one stage per rank"),
        (
            {"schedule": "interleaved-1f1b"},
            "GPipeStrategy(schedule='interleaved-1f1b', virtual_stages=1): 'interleaved-1f1b' runs v ≥ 2 stages per "
            "rank; use virtual_stages=2",
        ),
        ({"schedule": "interleaved-1f1b", "virtual_stages": 0}, "GPipeStrategy(virtual_stages=0): the stages of"),
        (
            {"schedule": "1f1b", "virtual_stages": 3},
            "GPipeStrategy(schedule='1f1b', virtual_stages=3): '1f1b' runs one stage per rank; use schedule='interl",
        ),
        (
            {"schedule": "zb-v"},
            "GPipeStrategy(schedule='zb-v', virtual_stages=1): 'zb-v' runs v ≥ 2 stages per rank; use virtual_stages=2",
        ),
    ],
)
def test_interleaving_arguments_are_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    from lightning_gpipe.strategy import GPipeStrategy

    with pytest.raises(ValueError) as caught:
        GPipeStrategy(**kwargs)
    assert str(caught.value).startswith(message), str(caught.value)


def test_the_partition_table_lists_the_chunks_and_the_ranks_that_hold_them() -> None:
    backbone = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    whole = WholeModel.read(backbone, "0", backbone)
    report = PartitionReport(whole, Plan([1, 2, 1, 2], "explicit"), [1, 2, 1, 2], None, ranks=2)
    assert report.header().startswith(
        "GPipeStrategy: self.0 split into 4 stages (virtual_stages=2: rank k holds stages k, k + 2, …) by the given"
    )
    columns = dict(report.table(lambda k: f"rank {k}"))
    assert columns["Chunk"] == ["0a", "1a", "0b", "1b"]
    assert columns["Layers"] == ["0 (0)", "1–2 (1 … 2)", "3 (3)", "4–5 (4 … 5)"]
    assert columns["Ranks"] == ["rank 0", "rank 1", "rank 0", "rank 1"]
    v = PartitionReport(whole, Plan([1, 2, 1, 2], "explicit"), [1, 2, 1, 2], None, ranks=2, placement="v")
    assert "(virtual_stages=2: rank k holds stages k and 3 − k)" in v.header()
    columns = dict(v.table(lambda k: f"rank {k}"))
    assert columns["Chunk"] == ["0a", "1a", "1b", "0b"] and columns["Ranks"] == ["rank 0", "rank 1", "rank 1", "rank 0"]
