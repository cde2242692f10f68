"""GPipeStrategy inside Lightning's loops: each feature gives the same run as plain torch doing the same computation.

Accumulation, clipping by norm and by value, manual optimization, LR schedulers, deferred BatchNorm, the
validate/test/predict loops and ``self.log`` (with ``sync_dist``) are each compared, parameter by parameter (≤ 1e-6
relative, fp32), with a plain single-process reference. Processes are few: one world-2 launch runs every pp=2
scenario as a sequence of ``Trainer`` runs (Lightning reuses the process group), one world-4 launch the pp=2 × dp=2
one; the tests below read the launches' cached results. The reference is ``tests/helpers/loops_reference.py``, the
runs ``tests/helpers/loops_run.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.loops_reference import BN_LAYERS, EVAL_SAMPLES, PP, make_net, rel
from tests.helpers.loops_run import WORLD2_CASES, case_results
from tests.helpers.tiny_fit import BATCH, LR

TOL = 1e-6


def check_training(world_size: int, name: str) -> list[dict[str, Any]]:
    """Weights equal the reference on every rank; the logged loss is the reference's loss of the last batch."""
    per_rank = case_results(world_size, name)
    for rank, r in enumerate(per_rank):
        assert r["max"] <= TOL, (name, rank, r["errors"])
        assert r["checked"] > 4, (name, rank, r["errors"])  # replicated prefix/head plus this stage's layers
        last = r["ref_losses"][r["dp_rank"]][-1]
        assert rel(r["metrics"]["train_loss"], last) <= TOL, (name, rank, r["metrics"], last)
    # Every parameter was compared on some stage of the pipeline.
    compared = set().union(*(r["errors"] for r in per_rank if r["dp_rank"] == 0))
    assert {n for n in compared if n.startswith("backbone.")} == {
        n for n, _ in make_net("batchnorm" in name).named_parameters() if n.startswith("backbone.")
    }
    return per_rank


# ---------------------------------------------------------------------------------------------------- the tests
T = 300  # the first test to read a launch pays for it (world 2 runs eleven Trainer.fit in sequence)


@pytest.mark.timeout(T)
@pytest.mark.parametrize("name", ["accumulate", "accumulate_uneven", "accumulate_clip_norm"])
def test_gradient_accumulation(name: str) -> None:
    """accumulate_grad_batches=2 (+ clipping by the global norm): two batches' gradients, each loss / 2, one step."""
    per_rank = check_training(2, name)
    if name == "accumulate_clip_norm":
        assert per_rank[0]["clipped"]  # the clip was active, so the comparison covers it


@pytest.mark.timeout(T)
def test_gradient_accumulation_with_data_parallel_replicas() -> None:
    """pp=2 × dp=2 with accumulation and clipping; every replica reads its own shard of the data."""
    per_rank = check_training(4, "dp_accumulate_clip_norm")
    assert per_rank[0]["clipped"]
    assert [r["dp_rank"] for r in per_rank] == [0, 0, 1, 1]
    assert [r["pp_rank"] for r in per_rank] == [0, 1, 0, 1]
    # Different data per replica (pytorch#60118: identical data hides a missing gradient reduction).
    assert per_rank[0]["metrics"]["train_loss"] != per_rank[2]["metrics"]["train_loss"]


@pytest.mark.timeout(T)
@pytest.mark.parametrize("name", ["fsdp_accumulate_clip_norm", "fsdp_manual_accumulate", "fsdp_evaluate"])
def test_sharded_replicas_accumulate_clip_and_step_manually(name: str) -> None:
    """pp=2 × dp=2 with data_parallel="fsdp": gradients accumulate whole over the window and are reduce-scattered
    once; clipping by the norm over stages and shards; manual_backward + opt.step() on the shards."""
    per_rank = check_training(4, name)
    # layout="auto" puts a stage's replicas on consecutive ranks under fsdp: rank k·D + d.
    assert [(r["pp_rank"], r["dp_rank"]) for r in per_rank] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert per_rank[0]["metrics"]["train_loss"] != per_rank[1]["metrics"]["train_loss"]
    if "clip" in name:
        assert per_rank[0]["clipped"]


@pytest.mark.timeout(T)
@pytest.mark.parametrize("name", ["manual", "manual_accumulate", "manual_clip_norm"])
def test_manual_optimization(name: str) -> None:
    """manual_backward + opt.step(); toggle_model(sync_grad=...) over a window of 2 batches; self.clip_gradients."""
    per_rank = check_training(2, name)
    if name == "manual_clip_norm":
        assert per_rank[0]["clipped"]


@pytest.mark.timeout(T)
def test_lr_scheduler_every_step() -> None:
    per_rank = check_training(2, "scheduler")
    for r in per_rank:
        assert r["lr"] == r["ref_lr"] == LR * 0.5**6, r


@pytest.mark.timeout(T)
def test_gradient_clipping_by_value() -> None:
    per_rank = check_training(2, "clip_value")
    assert per_rank[0]["clipped"]


def check_running_statistics(per_rank: list[dict[str, Any]]) -> None:
    """Every BatchNorm buffer equals the reference's on the stage holding it, and both BatchNorms were compared: the
    first one's input does not depend on earlier normalization, the second one's does."""
    found = {}
    for rank, r in enumerate(per_rank):
        assert all(e <= TOL for e in r["buffer_errors"].values()), (rank, r["buffer_errors"])
        found.update(r["buffer_errors"])
    stats = ("running_mean", "running_var", "num_batches_tracked")
    assert set(found) == {f"backbone.{i}.{k}" for i in BN_LAYERS for k in stats}


@pytest.mark.timeout(T)
def test_deferred_batchnorm_in_the_trainer() -> None:
    """Micro-batch normalization (weights equal a per-micro-batch plain run); running statistics equal nn.BatchNorm
    on the whole mini-batch, updated once per step. (Evaluation with them: test_validate_test_predict.)"""
    check_running_statistics(check_training(2, "batchnorm"))


@pytest.mark.timeout(T)
def test_sync_batchnorm_over_data_parallel_replicas() -> None:
    """pp = 2 × dp = 2, Trainer(sync_batchnorm=True): each micro-batch normalized with the statistics of all replicas'
    micro-batches (weights equal the plain run that normalizes them together); running statistics equal nn.BatchNorm
    on the whole global mini-batch, identical on the replicas."""
    check_running_statistics(check_training(4, "sync_batchnorm"))


@pytest.mark.timeout(T)
def test_sync_batchnorm_over_sharded_replicas() -> None:
    """The same with data_parallel="fsdp": BatchNorm's weights sharded, its running statistics whole on each replica."""
    check_running_statistics(check_training(4, "fsdp_sync_batchnorm"))


@pytest.mark.timeout(T)
@pytest.mark.parametrize(
    ("world_size", "name"),
    [
        (2, "evaluate"),
        (2, "batchnorm"),
        (4, "dp_accumulate_clip_norm"),
        (4, "sync_batchnorm"),
        (4, "fsdp_accumulate_clip_norm"),
        (4, "fsdp_sync_batchnorm"),
        (4, "fsdp_evaluate"),
    ],
)
def test_validate_test_predict(world_size: int, name: str) -> None:
    """After fit, the evaluation loops give the plain model's metrics and predictions, the same on every rank."""
    per_rank = check_training(world_size, name)
    want = per_rank[0]["ref_mse"]
    for rank, r in enumerate(per_rank):
        assert r["validated"] == per_rank[0]["validated"] and r["tested"] == per_rank[0]["tested"], rank
        (validated,) = r["validated"]
        (tested,) = r["tested"]
        assert set(validated) == {"val_loss", "val_mse"} and set(tested) == {"test_loss", "test_mse"}, r
        # The validation at the end of fit's epoch ran on the same (final) weights.
        for key in ("val_loss", "val_mse"):
            assert r["metrics"][key] == validated[key], (rank, key, r["metrics"], validated)
        for key, got in [*validated.items(), *tested.items()]:
            assert rel(got, want) <= TOL, (rank, key, got, want)
        # trainer.predict returns, and a BasePredictionWriter writes, each replica's predictions once: on its stage 0.
        dp = world_size // PP
        if r["pp_rank"] != 0:
            assert r["predict_none"] and r["written_batches"] == 0, (rank, r)
            continue
        assert not r["predict_none"], (rank, r)
        assert r["predict_rows"] == EVAL_SAMPLES // dp, r
        assert r["predict_batches"] == -(-EVAL_SAMPLES // dp // BATCH), r
        assert r["predict_err"] <= TOL, (rank, r["predict_err"])


@pytest.mark.timeout(T)
def test_logged_values_identical_on_every_rank() -> None:
    """self.log values and trainer.callback_metrics are the same on every stage, and equal the plain run's."""
    for case in WORLD2_CASES:
        per_rank = case_results(2, case.name)
        assert per_rank[0]["metrics"] == per_rank[1]["metrics"], (case.name, per_rank)
        metrics, losses = per_rank[0]["metrics"], per_rank[0]["ref_losses"][0]
        # dp = 1: synchronizing over the (single-rank) replicas leaves a value as it is, a sum included.
        assert metrics["train_loss_sync"] == metrics["train_loss_sum"] == metrics["train_loss"], (case.name, metrics)
        assert rel(metrics["train_loss"], losses[-1]) <= TOL, (case.name, metrics, losses)
        assert rel(metrics["epoch_loss"], sum(losses) / len(losses)) <= TOL, (case.name, metrics, losses)


@pytest.mark.timeout(T)
def test_sync_dist_reduces_over_data_parallel_replicas() -> None:
    """pp=2 × dp=2: sync_dist gives the mean (or sum) over the two replicas, not over the four ranks."""
    per_rank = case_results(4, "dp_accumulate_clip_norm")
    local = [per_rank[PP * d]["metrics"]["train_loss"] for d in range(2)]
    ref_local = [per_rank[0]["ref_losses"][d][-1] for d in range(2)]
    for rank, r in enumerate(per_rank):
        m = r["metrics"]
        assert m["train_loss"] == local[r["dp_rank"]], rank  # the same on the stages of one pipeline
        for key in ("train_loss_sync", "train_loss_sum", "epoch_loss"):
            assert m[key] == per_rank[0]["metrics"][key], (rank, key)  # the same everywhere
    m = per_rank[0]["metrics"]
    assert rel(m["train_loss_sync"], sum(local) / 2) <= TOL, (m, local)
    assert rel(m["train_loss_sum"], sum(local)) <= TOL, (m, local)  # not ×2 (over the world) nor ×4
    assert rel(m["train_loss_sync"], sum(ref_local) / 2) <= TOL, (m, ref_local)
    all_losses = [v for d in per_rank[0]["ref_losses"] for v in d]
    assert rel(m["epoch_loss"], sum(all_losses) / len(all_losses)) <= TOL, (m, all_losses)


@pytest.mark.timeout(T)
def test_reduce_boolean_decision_over_all_ranks() -> None:
    per_rank = case_results(2, "checkpoint_top_k")
    assert [r["all_true"] for r in per_rank] == [True, True]
    assert [r["any_rank0"] for r in per_rank] == [True, True]


@pytest.mark.timeout(T)
def test_model_checkpoint_top_k_keeps_the_best() -> None:
    """ModelCheckpoint(monitor="train_loss", save_top_k=1), every step: the best is the smallest logged loss."""
    per_rank = case_results(2, "checkpoint_top_k")
    losses = per_rank[0]["ref_losses"][0]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert best != 0  # otherwise the first checkpoint would be the right one by luck
    for r in per_rank:
        assert rel(r["best_score"], losses[best]) <= TOL, (r["best_score"], losses)
        assert r["best_path"] == f"epoch=0-step={best + 1}.ckpt", r["best_path"]
