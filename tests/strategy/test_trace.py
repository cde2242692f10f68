"""Pipeline timeline: the time breakdown of known schedules, and GPipeStrategy(trace_dir=...) writing real steps."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_gpipe.pipe.trace.events import Event, read_chrome_trace, write_chrome_trace
from lightning_gpipe.pipe.trace.gantt import plot_timeline
from lightning_gpipe.pipe.trace.stats import breakdown, theoretical_bubble, transfer_ns
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, dataset, lightning_module

UNIT = 1_000_000  # 1 ms in ns


def ideal_gpipe(K: int, M: int, backward_cost: int = 1, slow_stage: int | None = None) -> list[Event]:
    """GPipe's fill/drain with forward = 1 unit and backward = ``backward_cost`` units on every stage (twice both on
    ``slow_stage``'s forward), nothing recomputed; phases as the engine records them."""
    events: list[Event] = []
    f = [2 if k == slow_stage else 1 for k in range(K)]
    fwd_end = [[0] * M for _ in range(K)]
    for k in range(K):
        for m in range(M):
            start = max(fwd_end[k][m - 1] if m else 0, fwd_end[k - 1][m] if k else 0)
            fwd_end[k][m] = start + f[k]
            events.append(Event("forward", k, m, start * UNIT, fwd_end[k][m] * UNIT))
        events.append(Event("step", k, -1, (fwd_end[k][0] - f[k]) * UNIT, fwd_end[k][-1] * UNIT, "forward"))
    turn = fwd_end[K - 1][M - 1]
    bwd_end = [[0] * M for _ in range(K)]
    for k in reversed(range(K)):
        for r, m in enumerate(reversed(range(M))):
            prev = bwd_end[k][m + 1] if r else (turn if k == K - 1 else 0)
            start = max(prev, bwd_end[k + 1][m] if k < K - 1 else 0)
            bwd_end[k][m] = start + backward_cost
            events.append(Event("backward", k, m, start * UNIT, bwd_end[k][m] * UNIT))
        first = bwd_end[k][M - 1] - backward_cost
        events.append(Event("step", k, -1, first * UNIT, bwd_end[k][0] * UNIT, "backward"))
    return events


@pytest.mark.parametrize(("K", "M"), [(1, 4), (2, 1), (2, 4), (3, 8), (4, 4), (4, 32)])
@pytest.mark.parametrize("backward_cost", [1, 2])
def test_an_ideal_schedule_has_gpipes_bubble(K: int, M: int, backward_cost: int) -> None:
    stats = breakdown(ideal_gpipe(K, M, backward_cost))
    assert stats["K"] == K and stats["M"] == M
    assert stats["theoretical_bubble"] == pytest.approx((K - 1) / (M + K - 1))
    assert stats["bubble"] == pytest.approx(stats["theoretical_bubble"], abs=1e-12)
    assert stats["span_ms"] == pytest.approx((1 + backward_cost) * (M + K - 1))
    assert stats["load_imbalance"] == pytest.approx(0.0, abs=1e-12)
    shares = stats["shares"]
    assert shares["forward"] + shares["backward"] + shares["other"] == pytest.approx(1.0)
    assert stats["efficiency"] == pytest.approx(1.0)  # nothing but GPipe's own bubble


def test_efficiency_counts_the_loss_once_and_charges_a_slow_stage() -> None:
    K, M = 2, 4
    even = breakdown(ideal_gpipe(K, M))
    assert even["ideal_step_ms"] == pytest.approx(2 * (M + K - 1))
    # A loss of 2 units between the phases, run on every stage (as the whole-batch path does): the step grows by
    # 2, the ideal by the last stage's 2 units spread over K stages and stretched by (M+K−1)/M.
    turn = max(e.end_ns for e in ideal_gpipe(K, M) if e.kind == "forward")
    shifted = [
        e
        if e.kind == "forward" or (e.kind == "step" and e.label == "forward")
        else Event(e.kind, e.stage, e.micro_batch, e.start_ns + 2 * UNIT, e.end_ns + 2 * UNIT, e.label)
        for e in ideal_gpipe(K, M)
    ]
    with_loss = breakdown([*shifted, *(Event("loss", k, -1, turn, turn + 2 * UNIT) for k in range(K))])
    assert with_loss["span_ms"] == pytest.approx(even["span_ms"] + 2)
    assert with_loss["ideal_step_ms"] == pytest.approx(even["ideal_step_ms"] + 2 / K * (M + K - 1) / M)
    assert with_loss["efficiency"] < 1.0
    slow = breakdown(ideal_gpipe(K, M, slow_stage=0))
    assert slow["efficiency"] < 0.95


def test_a_slow_stage_shows_as_load_imbalance_and_a_larger_bubble() -> None:
    even, slow = breakdown(ideal_gpipe(2, 4)), breakdown(ideal_gpipe(2, 4, slow_stage=0))
    assert slow["load_imbalance"] > 0.05
    assert slow["bubble"] > even["bubble"]
    assert slow["stages"]["0"]["compute_ms"] == pytest.approx(12.0)  # 4 forwards of 2 units + 4 backwards of 1


def test_transfer_is_the_part_of_a_wait_after_the_peer_sent() -> None:
    phases = [Event("step", 0, -1, 0, 10 * UNIT, "forward"), Event("step", 1, -1, 0, 10 * UNIT, "forward")]
    events = [
        *phases,
        Event("send", 0, 0, 3 * UNIT, 3 * UNIT + 100),
        Event("recv-wait", 1, 0, 1 * UNIT, 4 * UNIT),  # waited 3 ms: 2 for stage 0's compute, 1 for the transfer
        Event("send", 0, 1, 5 * UNIT, 5 * UNIT + 100),
        Event("recv-wait", 1, 1, 7 * UNIT, 7 * UNIT + UNIT // 2),  # sent before the wait began: all transfer
    ]
    assert transfer_ns(events) == {1: UNIT + UNIT // 2}


def test_transfer_of_gradients_and_across_the_interleaved_ring_seam() -> None:
    """Loss inside (one "train" phase): a gradient wait is matched with the next stage's gradient send, an input
    wait on rank 0's second chunk with rank K − 1's first chunk's send."""
    phases = [Event("step", k, -1, 0, 10 * UNIT, "train") for k in (0, 1)]
    events = [
        *phases,
        Event("send", 1, 0, 3 * UNIT, 3 * UNIT + 100, "gradient", chunk=1),
        Event("send", 1, 0, 2 * UNIT, 2 * UNIT + 100, chunk=1),  # rank 1 chunk b's output: nobody waits for it
        Event("recv-wait", 0, 0, 2 * UNIT, 4 * UNIT, "gradient", chunk=1),  # 1 ms after rank 1 sent it
        Event("send", 1, 0, 5 * UNIT, 5 * UNIT + 100, chunk=0),
        Event("recv-wait", 0, 0, 5 * UNIT, 7 * UNIT, chunk=1),  # chunk b's input: rank 1 chunk a's output, 2 ms
    ]
    assert transfer_ns(events) == {0: 3 * UNIT}
    # A skip's wait (its sender is no neighbour) and a skip's send are not matched with the chain's.
    skips = [Event("send", 1, 0, 3 * UNIT, 3 * UNIT + 100, "skip gradient", chunk=1)]
    skips.append(Event("recv-wait", 0, 0, 6 * UNIT, 8 * UNIT, "skip gradient", chunk=1))
    assert transfer_ns(events + skips) == {0: 3 * UNIT}


def test_the_interleaved_ideal_bubble_divides_by_v() -> None:
    assert theoretical_bubble(2, 8, 2) == pytest.approx(1 / 17) and theoretical_bubble(2, 8) == pytest.approx(1 / 9)
    events = [Event("step", k, -1, 0, 10 * UNIT, "train") for k in (0, 1)]
    events += [Event("forward", k, 0, UNIT, 2 * UNIT, chunk=c) for k in (0, 1) for c in (0, 1)]
    assert breakdown(events)["chunks_per_rank"] == 2


def test_chrome_trace_round_trip_and_gantt(tmp_path: Path) -> None:
    events = ideal_gpipe(3, 4)
    write_chrome_trace(events, tmp_path / "t.json", metadata={"note": 1})
    assert json.loads((tmp_path / "t.json").read_text())["otherData"] == {"note": 1}
    assert sorted(read_chrome_trace(tmp_path / "t.json"), key=repr) == sorted(events, key=repr)
    stats = plot_timeline(events, tmp_path / "t.png", title="ideal")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stats["bubble"] == pytest.approx(theoretical_bubble(3, 4))


@pytest.mark.parametrize("bad", [-1, [], [1, -2], "5", [True]])
def test_bad_trace_steps_are_named(bad: object) -> None:
    from lightning_gpipe.strategy import GPipeStrategy

    with pytest.raises(ValueError, match="trace_steps"):
        GPipeStrategy(trace_steps=bad)  # type: ignore[arg-type]


M = 4


def traced_fit_worker(rank: int, world_size: int, trace_dir: str) -> list[str]:
    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")
    strategy = GPipeStrategy(chunks=M, pipeline_parallel_size=2, trace_dir=trace_dir, trace_steps=[1, 2, 50])
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lightning_module(), DataLoader(dataset(), batch_size=BATCH))
    return [str(w.message) for w in caught if "trace_steps" in str(w.message)]


@pytest.mark.timeout(200)
def test_strategy_traces_the_chosen_steps_of_every_stage(tmp_path: Path) -> None:
    """pp = 2 × dp = 2: the first replica's two stages traced at steps 1 and 2; a step that never runs is named."""
    warned = run_distributed(traced_fit_worker, 4, str(tmp_path), timeout=180, lightning=True)
    assert any("[50] never ran" in w for w in warned[0]), warned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1.json", "step_1.png", "step_2.json", "step_2.png"]
    events = read_chrome_trace(tmp_path / "step_1.json")
    stats = json.loads((tmp_path / "step_1.json").read_text())["otherData"]
    assert stats["step"] == 1 and stats["K"] == 2 and stats["M"] == M
    assert stats["theoretical_bubble"] == pytest.approx(1 / (M + 1))
    for k in (0, 1):
        mine = [e for e in events if e.stage == k]
        kinds = ("forward", "recompute", "backward", "loss", "status", "reduce", "update")
        count = {kind: sum(e.kind == kind for e in mine) for kind in kinds}
        # except_last: the last micro-batch keeps its graph; one loss, one reduction and one update per step; one
        # status check, after the backward phase (the output broadcast ends the forward phase on every stage).
        once = {"loss": 1, "status": 1, "reduce": 1, "update": 1}
        assert count == {"forward": M, "recompute": M - 1, "backward": M, **once}, (k, count)
        # The loss fills the gap between the phases exactly.
        phases = {e.label: e for e in mine if e.kind == "step"}
        loss = next(e for e in mine if e.kind == "loss")
        assert phases["forward"].end_ns == loss.start_ns <= loss.end_ns <= phases["backward"].start_ns
        assert stats["stages"][str(k)]["loss_ms"] > 0
        assert 0.0 < stats["stages"][str(k)]["bubble"] < 1.0
    # Stage 1 computes micro-batch m only after stage 0 finished it: on one host the stages share stage 0's origin,
    # so the two clocks line up exactly.
    first = {k: next(e for e in events if (e.stage, e.kind, e.micro_batch) == (k, "forward", 0)) for k in (0, 1)}
    assert first[1].start_ns >= first[0].end_ns, first
    assert (tmp_path / "step_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
