"""The simulator as a cost model (benchmarks/_lib/costmodel.py): stage costs from layer costs, a step by hand."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from benchmarks._lib import costmodel
from benchmarks._lib.costmodel import LayerCosts, predict, profile_layers
from benchmarks._lib.costmodel_ranks import action_times, replayed
from benchmarks._lib.costmodel_report import replay_row
from benchmarks._lib.gloo_link import Link, fit_host, fit_link
from lightning_gpipe.pipe.schedule.simulator import Costs
from lightning_gpipe.pipe.state import batchnorm
from lightning_gpipe.pipe.trace.events import Event

# Two layers, one per stage. Layer 0: forward 1 (no grad), 1.5 kept under grad, 1.25 recomputed, backward 2; layer 1:
# 0.8 / 1 / 0.9, backward 2; the loss 0.5. Split (a rank that runs W's): kept forwards and recomputes 0.5 dearer,
# I + W = the backward + 1. Its output: 100 bytes forward, 200 bytes of gradient back; gloo: 0.1 latency, 1000
# bytes/unit.
LAYERS = LayerCosts(
    n=4,
    forward=[1.0, 0.8],
    kept=[1.5, 1.0],
    recompute=[1.25, 0.9],
    backward=[2.0, 2.0],
    update=[0.25, 0.125],
    out_bytes=[[100], [40]],
    grad_bytes=[[200], [40]],
    split_kept=[2.0, 1.5],
    split_recompute=[1.75, 1.4],
    split_input=[1.25, 1.5],
    split_weight=[1.75, 1.5],
    loss=0.5,
)
LINK = Link(latency=0.1, bandwidth=1000.0)
NO_LINK = Link(latency=0.0, bandwidth=float("inf"))


def stage(p: object, s: int) -> Costs:
    return Costs(**{k: v for k, v in p.costs[s].items() if k != "stage"})  # type: ignore[attr-defined]


def test_stage_costs_from_layer_costs() -> None:
    p = predict(LAYERS, LINK, "gpipe", 2, 2, checkpoint="except_last")
    assert p.balance == [1, 1]
    # Stage 0 drops both graphs (each forward is followed by another forward or another backward): its forwards run
    # without grad, each backward recomputes -- as the engine recomputes. The header and the tensor each pay the
    # latency.
    first = Costs(F=1.0, F_kept=1.5, B=2.0, I=1.25, W=1.75, R=1.25, transfer=0.1 + 0.1 + 0.1, grad_transfer=0.0)
    assert stage(p, 0) == replace(first, grad_send_host=0.0)  # sends no gradient: no host time for one
    # The last stage keeps its graphs (forward under grad) and begins each backward with the loss.
    last = Costs(F=0.8, F_kept=1.0, B=2.5, I=2.0, W=1.5, R=0.9, transfer=0.0, grad_transfer=0.1 + 0.1 + 0.2)
    assert stage(p, 1) == replace(last, grad_send_host=0.0)


def test_a_messages_host_time_is_its_ranks() -> None:
    """The host time of each message a stage sends or receives (fixed + per tensor: ``fit_host``) enters its costs:
    stage 0 sends its output (one tensor) and receives its gradient; the last stage sends the input gradient."""
    samples = [(n, 0.01 + 0.002 * n, 0.03 + 0.004 * n) for n in (1, 2, 3, 4)]
    link = fit_host(LINK, samples)
    assert link.send_host == pytest.approx((0.01, 0.002)) and link.recv_host == pytest.approx((0.03, 0.004))
    assert (link.latency, link.bandwidth) == (LINK.latency, LINK.bandwidth)
    assert link.sender([100, 0, 40]) == pytest.approx(0.014)  # the transport sends no empty tensor
    p = predict(LAYERS, link, "gpipe", 2, 2, checkpoint="except_last")
    assert (stage(p, 0).send_host, stage(p, 0).recv_host) == pytest.approx((0.012, 0.034))
    assert (stage(p, 1).grad_send_host, stage(p, 1).send_host, stage(p, 1).recv_host) == pytest.approx((0.012, 0, 0))
    # The step by hand below, where each message leaves after its sender's host time: activation 0 0.012 later (and
    # with it rank 1's whole chain), gradients 0 and 1 another 0.012 each; rank 0's posting and reading of its
    # gradients (0.034) hides in its recomputes.
    assert p.makespan == pytest.approx(11.0 + 3 * 0.012)


def test_two_stage_gpipe_step_by_hand() -> None:
    # gloo: a transfer starts once both the send and its receive are posted and takes 0.3 forward, 0.4 back.
    #   rank 0: F0 0–1, F1 1–2; B0 posts its receive at 2, recomputes until 3.25, gets grad 0 at 5.2: 5.2–7.2;
    #           B1 posts at 7.2, recomputes until 8.45, gets grad 1 at 9.0: 9.0–11.0.
    #   rank 1: F0 (kept) gets act 0 at 1.3: 1.3–2.3; B0 2.3–4.8 (loss + backward), grad 0 sent 4.8 → 5.2;
    #           F1 posts at 4.8, act 1 (sent at 2) arrives 5.1: 5.1–6.1; B1 6.1–8.6, grad 1 → 9.0.
    # Step: 11.0, then the status all-reduce (a round trip: 0.2), then the longer update (0.25): 11.45. Work:
    # 1 + 1 + 2 + 2 + 1.25 + 1.25 (rank 0), 2 × (1 + 2.5) (rank 1), and the updates.
    p = predict(LAYERS, LINK, "gpipe", 2, 2, checkpoint="except_last")
    assert p.makespan == pytest.approx(11.0)
    assert p.step == pytest.approx(11.45)
    assert p.work == pytest.approx(8.5 + 7.0 + 0.375)
    assert p.on_cores(1) == pytest.approx(15.875)  # one core: the work, serialized, is the longer
    assert p.on_cores(2) == pytest.approx(11.45)
    # Per rank, the kinds of work and the rest add up to the step.
    assert p.ranks[0] == pytest.approx({"forward": 2, "recompute": 2.5, "backward": 4, "update": 0.25, "other": 2.7})
    assert p.ranks[1]["forward"] == pytest.approx(2.0) and p.ranks[1]["backward"] == pytest.approx(5.0)
    assert sum(p.ranks[1].values()) == pytest.approx(p.step)
    # 1F1B on two ranks and two micro-batches is the same order on rank 0 (F0 F1 B0 B1): the same step.
    assert predict(LAYERS, LINK, "1f1b", 2, 2, checkpoint="except_last").step == pytest.approx(11.45)


def test_zb_h1_splits_on_the_ranks_that_run_w_only() -> None:
    # K = 2: rank 0's I's are each followed by their W, which the executor fuses into B (no split there); rank 1 runs
    # I and W apart: its kept forwards and its halves pay the split.
    p = predict(LAYERS, NO_LINK, "zb-h1", 2, 2, checkpoint="except_last")
    first, last = stage(p, 0), stage(p, 1)
    assert (first.F_kept, first.R, first.B) == (1.5, 1.25, 2.0)
    assert (last.F_kept, last.I, last.W, last.R) == (1.5, 2.0, 1.5, 1.4)
    # The last rank's work: two split forwards, two I (with the loss), two W.
    assert p.ranks[1]["forward"] == pytest.approx(3.0) and p.ranks[1]["backward"] == pytest.approx(7.0)


def test_engine_factors_per_stage_scale_that_stage_only() -> None:
    plain = predict(LAYERS, NO_LINK, "gpipe", 2, 2)
    scaled = predict(LAYERS, NO_LINK, "gpipe", 2, 2, engines={(0, 1): 2.0})
    assert stage(scaled, 0) == Costs(F=2.0, F_kept=3.0, B=4.0, I=2.5, W=3.5, R=2.5, grad_transfer=0.0, grad_send_host=0)
    assert stage(scaled, 1) == stage(plain, 1)
    # Without a stage's factor, the one-process one: the whole model's engine × the co-run factor (K ≥ 2).
    one = predict(LayerCosts(**{**LAYERS.as_dict(), "engine": 2.0, "corun": 1.5}), NO_LINK, "gpipe", 2, 2)
    assert stage(one, 1).F == pytest.approx(0.8 * 3.0)
    assert one.step - one.makespan == pytest.approx(0.25 * 1.5)  # the update: measured as it runs, co-run


def test_layers_are_a_model_of_their_own() -> None:
    first, last = LAYERS.layers(0, 1), LAYERS.layers(1, 2)
    assert (first.forward, first.split_weight, first.loss) == ([1.0], [1.75], 0.0)
    assert (last.recompute, last.out_bytes, last.loss) == ([0.9], [[40]], 0.5)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    link = fit_link([(b, 2e-4 + b / 2e9) for b in (64, 1 << 16, 1 << 20, 1 << 22)])
    assert link.latency == pytest.approx(2e-4)
    assert link.bandwidth == pytest.approx(2e9)


def test_profile_layers_times_each_kind_as_the_engine_runs_it() -> None:
    """A recompute runs deferred BatchNorm without accumulating its statistics: it must be timed so, not as a kept
    forward. The profile's clock here advances only while BatchNorm accumulates (one second a call), so each kind's
    time says whether it accumulated, whatever else runs on the machine."""

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    accumulate = batchnorm._Deferral.accumulate
    clock = SimpleNamespace(now=0.0)

    def counted(self: object, *args: object, **kwargs: object) -> None:
        clock.now += 1.0
        accumulate(self, *args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batchnorm._Deferral, "accumulate", counted)
        mp.setattr(costmodel, "time", SimpleNamespace(perf_counter=lambda: clock.now))
        lc = profile_layers(model, torch.randn(8, 4), lambda y: y.sum(), repeat=1)
    assert lc.kept[1] == lc.forward[1] == lc.split_kept[1] == 1.0
    assert lc.recompute[1] == lc.split_recompute[1] == 0.0
    assert len(lc.split_input) == len(lc.split_weight) == 3


def test_relative_step_is_the_paired_rounds_median_beside_the_prediction() -> None:
    from benchmarks._lib.costmodel_report import relative

    # Nine rounds: GPipe's step drifts 1.0 → 1.8 s while 1F1B's stays 1.1 × GPipe's of its round (1.3 × in one round,
    # and one disturbed round at 5 × that must not count): the ratio of the medians would read the drift, not 1.1.
    gpipe = [{"s": 1.0 + 0.1 * i, "clean": True} for i in range(10)]
    ratios = [1.1] * 8 + [1.3, 5.0]
    other = [{"s": g["s"] * r, "clean": r < 5} for g, r in zip(gpipe, ratios, strict=True)]
    row = relative(1.05, {"gpipe": gpipe, "1f1b": other}, "1f1b")
    assert row["vs_gpipe_measured"] == pytest.approx(1.1)
    assert row["relative_ratio"] == pytest.approx(1.05 / 1.1)
    assert row["relative_within"] == "yes"
    low, high = (float(x) for x in row["vs_gpipe_ci"].split("–"))
    assert low == pytest.approx(1.1) and high == pytest.approx(1.3)  # ranks 1 and 9 of 9: the whole range
    assert relative(1.25, {"gpipe": gpipe, "1f1b": other}, "1f1b")["relative_within"] == "no"  # 1.136 × measured
    assert relative(1.0, {"gpipe": gpipe}, "gpipe") == {"vs_gpipe_predicted": 1.0, "relative_within": "reference"}
    assert relative(1.2, {"zb-h1": other}, "zb-h1") == {}  # no GPipe measured: nothing to pair with


def test_action_times_are_each_actions_own_time_from_the_previous_ones_end() -> None:
    """An action runs from its previous one's end (the first: from its phase's start) to its own, less the waits for
    a peer; a backward's recompute is counted apart. The engine's work between events (the send at 14–15, the
    posting at 14–16) goes to the action it precedes."""
    events = [
        Event("step", 0, -1, 0, 100, "train"),
        Event("recv-wait", 0, 0, 2, 5),
        Event("forward", 0, 0, 5, 10),
        Event("forward", 0, 1, 10, 14),
        Event("send", 0, 1, 14, 15),
        Event("recompute", 0, 0, 16, 20),
        Event("recv-wait", 0, 0, 20, 24, "gradient"),
        Event("backward", 0, 0, 24, 30),
    ]
    got = {key: seconds * 1e9 for key, seconds in action_times(events).items()}
    want = {("forward", 0, 0): 7, ("forward", 1, 0): 4, ("recompute", 0, 0): 4, ("backward", 0, 0): 8}
    assert got == pytest.approx(want)


def test_replay_runs_the_simulator_on_the_traced_action_times() -> None:
    """``replayed`` with the prediction's own costs as a traced step's action times gives the prediction's step; a
    slower last-stage backward (3.5 instead of 2.5) gives the step worked out by hand; the row takes each traced
    step's replay over that step, and the median."""
    p = predict(LAYERS, LINK, "gpipe", 2, 2, checkpoint="except_last")
    first = [["forward", m, 0, 1.0] for m in (0, 1)]
    first += [[kind, m, 0, t] for m in (0, 1) for kind, t in (("recompute", 1.25), ("backward", 2.0))]

    def last(backward: float) -> list[list]:
        return [["forward", m, 0, 1.0] for m in (0, 1)] + [["backward", m, 0, backward] for m in (0, 1)]

    steps = [11.45, 13.45, 12.0]
    traced = [
        {"units": [first, first, first], "updates": [0.25, 0.25, 0.25], "steps": steps},
        {"units": [last(2.5), last(3.5), last(3.5)], "updates": [0.125, 0.125, 0.125], "steps": steps},
    ]
    assert replayed(p, traced, LINK, "except_last", 0) == pytest.approx(p.step)
    # rank 1: B0 2.3–5.8, grad 0 at 6.2; F1 posts at 5.8, act 1 arrives 6.1: 6.1–7.1; B1 7.1–10.6, grad 1 at 11.0.
    # rank 0: B0 6.2–8.2; B1 posts at 8.2, recomputes until 9.45, waits: 11.0–13.0. + status 0.2 + update 0.25.
    assert replayed(p, traced, LINK, "except_last", 1) == pytest.approx(13.45)
    row = replay_row(p, traced, LINK, "except_last")
    assert row["replayed_ms"] == pytest.approx(13450) and row["traced_ms"] == pytest.approx(12000)
    assert row["replayed_per_step"] == pytest.approx([1.0, 1.0, 13.45 / 12])
    assert row["replayed_ratio"] == pytest.approx(1.0)
    assert row["replayed_within"] == "yes"
    assert replay_row(p, [{"step": 1.0}, {"step": 1.0}], LINK, "except_last") == {}  # traced before the replay
