"""The simulator as a cost model (benchmarks/_lib/costmodel.py): stage costs from layer costs, a step by hand."""

from __future__ import annotations

import pytest

from benchmarks._lib.costmodel import LayerCosts, Link, fit_link, predict
from lightning_gpipe.pipe.simulator import Costs

# Two layers, one per stage. Layer 0: forward 1 (no grad), 1.5 under grad, backward 2; layer 1: 0.8 / 1, backward
# 2; the loss 0.5. Its output: 100 bytes forward, 200 bytes of gradient back; gloo: 0.1 latency, 1000 bytes/unit.
LAYERS = LayerCosts(
    n=4,
    forward=[1.0, 0.8],
    recompute=[1.5, 1.0],
    backward=[2.0, 2.0],
    input_grad=[0.75, 1.0],
    update=[0.25, 0.125],
    out_bytes=[[100], [40]],
    grad_bytes=[[200], [40]],
    loss=0.5,
)
LINK = Link(latency=0.1, bandwidth=1000.0)


def test_stage_costs_from_layer_costs() -> None:
    p = predict(LAYERS, LINK, "gpipe", 2, 2, checkpoint="except_last")
    assert p.balance == [1, 1]
    first, last = (Costs(**{k: v for k, v in c.items() if k != "stage"}) for c in p.costs)
    # Stage 0 drops both graphs (each forward is followed by another forward or another backward): its forwards run
    # without grad, each backward recomputes. The header and the tensor each pay the latency.
    assert first == Costs(F=1.0, B=2.0, I=0.75, W=1.25, R=1.5, transfer=0.1 + 0.1 + 0.1, grad_transfer=0.0)
    # The last stage keeps its graphs (forward under grad) and begins each backward with the loss.
    assert last == Costs(F=1.0, B=2.5, I=1.5, W=1.0, R=1.0, transfer=0.0, grad_transfer=0.1 + 0.1 + 0.2)


def test_two_stage_gpipe_step_by_hand() -> None:
    # gloo: a transfer starts once both the send and its receive are posted and takes 0.3 forward, 0.4 back.
    #   rank 0: F0 0–1, F1 1–2; B0 posts its receive at 2, recomputes until 3.5, gets grad 0 at 5.2: 5.2–7.2;
    #           B1 posts at 7.2, recomputes until 8.7, gets grad 1 at 9.0: 9.0–11.0.
    #   rank 1: F0 gets act 0 at 1.3: 1.3–2.3; B0 2.3–4.8 (loss + backward), grad 0 sent 4.8 → 5.2;
    #           F1 posts at 4.8, act 1 (sent at 2) arrives 5.1: 5.1–6.1; B1 6.1–8.6, grad 1 → 9.0.
    # Step: 11.0, then the status all-reduce (a round trip: 0.2), then the longer update (0.25): 11.45. Work:
    # 1 + 1 + 2 + 2 + 1.5 + 1.5 (rank 0), 2 × (1 + 2.5) (rank 1), and the updates.
    p = predict(LAYERS, LINK, "gpipe", 2, 2, checkpoint="except_last")
    assert p.makespan == pytest.approx(11.0)
    assert p.step == pytest.approx(11.45)
    assert p.work == pytest.approx(9.0 + 7.0 + 0.375)
    assert p.on_cores(1) == pytest.approx(16.375)  # one core: the work, serialized, is the longer
    assert p.on_cores(2) == pytest.approx(11.45)
    # 1F1B on two ranks and two micro-batches is the same order on rank 0 (F0 F1 B0 B1): the same step.
    assert predict(LAYERS, LINK, "1f1b", 2, 2, checkpoint="except_last").step == pytest.approx(11.45)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    link = fit_link([(b, 2e-4 + b / 2e9) for b in (64, 1 << 16, 1 << 20, 1 << 22)])
    assert link.latency == pytest.approx(2e-4)
    assert link.bandwidth == pytest.approx(2e9)


def test_the_engine_factor_scales_compute_not_transfers() -> None:
    no_link = Link(latency=0.0, bandwidth=float("inf"))
    plain = predict(LAYERS, no_link, "gpipe", 2, 2, checkpoint="except_last")
    scaled = predict(LayerCosts(**{**LAYERS.as_dict(), "engine": 2.0}), no_link, "gpipe", 2, 2)
    assert scaled.makespan == pytest.approx(2 * plain.makespan)
    assert scaled.step - scaled.makespan == pytest.approx(0.25)  # the update is measured as the optimizer runs it
