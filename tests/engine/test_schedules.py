"""Schedules as data (``pipe.schedule.registry``) run on the simulator: valid over a grid, their known times and memory,
the drawn diagrams, and the errors of a schedule that is wrong or that NCCL's ordering rules would hang."""

from __future__ import annotations

import re

import pytest

import lightning_gpipe.pipe.schedule.registry as schedules_module
from lightning_gpipe.pipe.schedule.registry import SCHEDULES, Action, executed, inputs_ahead, lookup
from lightning_gpipe.pipe.schedule.simulator import Costs, ScheduleError, draw, simulate


def _cells(row: str) -> str:
    """A drawn row's cells, one space apart, without the idle tail."""
    cells = row.split()
    while cells and cells[-1] == ".":
        cells.pop()
    return " ".join(cells)


def drawn(name: str) -> tuple[list[str], list[int]]:
    """The rows drawn for ``name`` in pipe.schedule.registry' docstring, and its line of peaks."""
    rows: list[str] = []
    peak: list[int] = []
    column = None
    for line in (schedules_module.__doc__ or "").splitlines():
        names = re.findall(r'"([a-z0-9-]+)"', line)
        if names:
            column = names.index(name) if name in names else None
            continue
        if column is None:
            continue
        if re.search(r"r\d+ \|", line):
            rows.append(_cells(re.findall(r"r\d+ \|((?:(?!r\d+ \|).)*)", line)[column]))
        elif "peak live per rank:" in line:
            text = re.findall(r"peak live per rank: ([\d, ]+\d)", line)[column]
            peak = [int(n) for n in text.split(",")]
            column = None
    return rows, peak


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_drawn_schedules_are_what_the_action_lists_do(name: str) -> None:
    K, M, v = SCHEDULES[name].example
    actions, placement = SCHEDULES[name].actions(K, M, v), SCHEDULES[name].placement
    rows, peak = drawn(name)
    assert rows == [_cells(row.split("|")[1]) for row in draw(actions, K, v, placement=placement)[1:]]
    assert len(rows) == K
    assert peak == simulate(actions, K, v, placement=placement).peak


def test_lookup_names_the_registered_schedules() -> None:
    assert lookup("zb-h1") is SCHEDULES["zb-h1"]
    with pytest.raises(ValueError, match=re.escape("schedule='zb-h2' is not one of")):
        lookup("zb-h2")
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"} <= set(SCHEDULES)


def _refusal(name: str, K: int, M: int, v: int) -> str | None:
    """What the registry says to a combination the schedule refuses (None: it accepts it)."""
    try:
        SCHEDULES[name].actions(K, M, v)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9])
@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_valid_and_free_of_deadlocks_under_nccl_rules(name: str, K: int, M: int, v: int) -> None:
    refusal = _refusal(name, K, M, v)
    if refusal is not None:
        if not SCHEDULES[name].accepts(v):
            assert f"schedule {name!r} takes v " in refusal and f"got v = {v}" in refusal, refusal
        else:  # torch's rounds of M / max(1, M // K) micro-batches: M a multiple of max(1, M // K)
            assert name in ("interleaved-1f1b", "interleaved-zb") and M % max(1, M // K), refusal
            assert f"M = {M} with K = {K} is not; use M < {2 * K}, or M = " in refusal, refusal
        return
    actions, placement = executed(name, K, M, v), SCHEDULES[name].placement
    assert len(actions) == K
    unit = Costs(F=1 / v, B=2 / v, I=1 / v, W=1 / v)  # a rank's v virtual stages cost what one stage costs
    result = simulate(actions, K, v, unit, placement=placement)  # the runtime's communicator layout, NCCL's rules
    assert simulate(actions, K, v, unit, nccl=False, placement=placement).makespan <= result.makespan + 1e-9
    assert max(result.finish) == result.makespan and 0 <= result.bubble < 1
    one_f_one_b = simulate(SCHEDULES["1f1b"].actions(K, M, 1), K)
    if name == "gpipe":
        assert result.peak[0] == (M if K > 1 else 1) and max(result.peak) <= M  # one rank: F0 B0 F1 B1 …
        assert simulate(actions, K, nccl=False).makespan == 3 * (M + K - 1)
        assert simulate(actions, K, layout="link").makespan == 3 * (M + K - 1)
    if name == "1f1b":
        assert result.peak == [min(M, K - k) for k in range(K)]
        assert result.makespan == 3 * (M + K - 1)
        assert result.finish == [3 * (M + K - 1) - 2 * k for k in range(K)]
    if name == "zb-h1":
        assert max(result.peak) <= max(one_f_one_b.peak)
        if M >= K >= 2:
            assert result.makespan < one_f_one_b.makespan
            assert result.makespan == 3 * M + K - 1  # ZB-H1's bubble: (K − 1)(F + I − W)
    if name == "interleaved-1f1b" and M >= K >= 2:
        assert result.makespan < one_f_one_b.makespan - 1e-9
    if name == "interleaved-zb" and M >= K >= 2:  # ahead of both its parts, in no more memory than interleaving's
        interleaved = simulate(executed("interleaved-1f1b", K, M, v), K, v, unit)
        zb_h1 = simulate(executed("zb-h1", K, M), K, 1, Costs(F=1, B=2, I=1, W=1))
        assert result.makespan < min(interleaved.makespan, zb_h1.makespan) - 1e-9
        assert max(result.peak) <= max(interleaved.peak)
    if name == "zb-v":  # 1F1B's activation memory (a chunk holds half a stage's), never slower than ZB-H1
        assert max(result.peak) / v <= max(one_f_one_b.peak)
        zb_h1 = simulate(executed("zb-h1", K, M), K, 1, Costs(F=1, B=2, I=1, W=1))
        assert result.makespan <= zb_h1.makespan + 1e-9
        if M >= 2 * K >= 4:
            assert result.makespan < zb_h1.makespan - 1e-9
            assert result.makespan <= 3 * M + 0.5 * (K - 1) + 1e-9, result.makespan  # the ramp only


def test_one_communicator_for_both_directions_deadlocks_under_nccl_rules_only() -> None:
    """K = 2 with the loss inside on one communicator: rank 0 sends a0 and a1 before it receives g0, rank 1 sends
    g0 before it receives a1; with rendezvous sends run in posting order neither moves, buffered sends pass."""
    actions = SCHEDULES["gpipe"].actions(2, 2, 1)
    simulate(actions, 2, layout="single", nccl=False, ahead=False)
    simulate(actions, 2)  # the runtime's layout: activations and gradients on two communicators
    with pytest.raises(ScheduleError) as caught:
        simulate(actions, 2, layout="single", ahead=False)  # the runtime that hung posted no input ahead
    text = str(caught.value)
    assert text.startswith("the schedule deadlocks under NCCL's rules (single communicator layout): ")
    assert "rank 0 is in B0 (action 3 of 4, stage 0) and waits for micro-batch 0's gradient from stage 1" in text
    assert "rank 0's send to rank 1 of micro-batch 1's activation from stage 0 waits for its receive" in text
    assert "rank 1 is in F1 (action 3 of 4, stage 1) and waits for micro-batch 1's activation from stage 0" in text
    assert "rank 1's send to rank 0 of micro-batch 0's gradient from stage 1 waits for its receive" in text
    assert "With buffered sends (gloo) it would run" in text


def test_interleaving_deadlocks_with_a_communicator_per_direction_of_flow() -> None:
    """Activations around the ring (rank K − 1 → rank 0 between chunks) on one communicator form a cycle; the
    runtime's layout, by rank order, puts that hop on the other communicator and runs."""
    actions = SCHEDULES["interleaved-1f1b"].actions(2, 2, 2)
    simulate(actions, 2, 2)
    with pytest.raises(ScheduleError, match=r"under NCCL.s rules \(flow communicator layout\): rank 0 is in F1b"):
        simulate(actions, 2, 2, layout="flow")


def test_an_order_against_the_data_dependencies_is_a_deadlock_even_with_buffered_sends() -> None:
    F, B = (lambda m: Action("F", m)), (lambda m: Action("B", m))
    actions = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]]  # rank 1 waits for a1 before sending g0
    for nccl in (True, False):
        with pytest.raises(ScheduleError) as caught:
            simulate(actions, 2, nccl=nccl)
        text = str(caught.value)
        assert "rank 0 is in B0 (action 2 of 4, stage 0) and waits for micro-batch 0's gradient from stage 1" in text
        assert "rank 1 is in F1 (action 2 of 4, stage 1) and waits for micro-batch 1's activation from stage 0" in text
    with pytest.raises(
        ScheduleError, match="It deadlocks with buffered sends too: the action order contradicts the data"
    ):
        simulate(actions, 2)


def test_two_ends_that_order_their_transfers_differently_are_refused() -> None:
    F, B = (lambda m: Action("F", m)), (lambda m: Action("B", m))
    actions = [[F(0), F(1), B(0), B(1)], [F(1), B(1), F(0), B(0)]]
    with pytest.raises(ScheduleError) as caught:
        simulate(actions, 2)
    assert str(caught.value).startswith(
        "rank 1's receive of micro-batch 1's activation from stage 0 would meet rank 0's send of micro-batch 0's "
        "activation from stage 0 on the 0 → 1 (activations) communicator"
    )


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        (
            [Action("F", 0), Action("F", 1), Action("B", 1)],
            "rank 0, micro-batch 0 on chunk 0 (stage 0): has F; it needs",
        ),
        (
            [Action("B", 0), Action("F", 0)],
            "rank 0, micro-batch 0 on chunk 0 (stage 0): runs B F; it must run F, then B",
        ),
        ([Action("F", 0), Action("W", 0), Action("I", 0)], "runs F W I; it must run F, then B (or I, then W)"),
        ([Action("F", 0), Action("B", 0), Action("B", 0)], "has F B B; it needs F and B, or F, I and W"),
        ([Action("F", 0), Action("B", 0, 1)], "Action(kind='B', m=0, c=1) is not an action"),
    ],
)
def test_invalid_action_lists_are_refused(ops: list[Action], message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        simulate([ops], 1)
    with pytest.raises(ScheduleError, match=re.escape("action lists for 1 ranks, but K = 2")):
        simulate([ops], 2)


def test_costs_recompute_and_transfers() -> None:
    """1F1B at K = 2, M = 1: a transfer delays each hop; rank 0 recomputes while it waits for its gradient (free),
    the last rank only after its forward (on the critical path)."""
    actions = SCHEDULES["1f1b"].actions(2, 1, 1)
    assert simulate(actions, 2).makespan == 6
    assert simulate(actions, 2, costs=Costs(transfer=0.5)).makespan == 7
    assert simulate(actions, 2, costs=Costs(R=1), checkpoint="always").makespan == 7
    assert simulate(actions, 2, costs={(1, 0): Costs(R=1)}, checkpoint="always").timeline[0][1][1:] == (5, 7)
    assert simulate(actions, 2, costs={(0, 0): Costs(R=3)}, checkpoint="always").makespan == 6
    assert simulate(actions, 2, costs={(0, 0): Costs(R=4)}, checkpoint="always").makespan == 7
    assert simulate(actions, 2, costs=Costs(R=1), checkpoint="except_last").makespan == 6  # F0 B0 keeps its graph


def test_a_message_costs_its_ranks_host_time() -> None:
    """1F1B at K = 2, M = 2 (F 1, B 2, no transfer time). Posting a send takes the sender 0.25, and the message leaves
    after it: rank 0's F1 runs 1.25–2.25; rank 1's F0 1.25–2.25, B0 2.25–4.25, F1 4.5–5.5, B1 5.5–7.5, whose
    gradient leaves at 7.75. Posting and reading an output gradient takes the receiver ``recv_host``, which a wait
    hides: rank 0's B1 posts at 6.5 and starts when the gradient comes, 7.75 (9.75 in all, 9 without host time);
    with 2, it starts at 8.5 although the gradient came at 7.75."""
    actions = SCHEDULES["1f1b"].actions(2, 2, 1)
    assert simulate(actions, 2, nccl=False).makespan == 9
    result = simulate(actions, 2, costs=Costs(send_host=0.25, recv_host=0.5), nccl=False)
    spans = [[(start, end) for _, start, end in row] for row in result.timeline]
    assert spans[0] == [(0, 1), (1.25, 2.25), (4.5, 6.5), (7.75, 9.75)]
    assert spans[1] == [(1.25, 2.25), (2.25, 4.25), (4.5, 5.5), (5.5, 7.5)]
    assert result.makespan == 9.75
    assert simulate(actions, 2, costs=Costs(send_host=0.25, recv_host=2), nccl=False).makespan == 10.5
    # An input gradient's send may cost another time than an activation's: rank 1's gradients leave 1 after B.
    result = simulate(actions, 2, costs=Costs(send_host=0.25, grad_send_host=1), nccl=False)
    assert result.timeline[1][2][1:] == (5.25, 6.25) and result.makespan == 11.25


def test_a_kept_forward_costs_f_kept_a_dropped_one_f() -> None:
    """GPipe at K = 2, M = 2, ``except_last``: rank 0 drops both graphs (forward F = 1 each), the last rank keeps
    both (F_kept = 3 each): rank 1 runs 1–4, 4–6, 6–9, 9–11 and rank 0's B1 ends at 13; with every graph kept
    (``never``) rank 0 pays F_kept too. Without F_kept, F is every forward's cost: 9."""
    actions = SCHEDULES["gpipe"].actions(2, 2, 1)
    costs = Costs(F=1, F_kept=3, B=2)
    result = simulate(actions, 2, costs=costs, checkpoint="except_last")
    assert [end - start for a, start, end in result.timeline[0] if a.kind == "F"] == [1, 1]
    assert [end - start for a, start, end in result.timeline[1] if a.kind == "F"] == [3, 3]
    assert simulate(actions, 2, costs=costs, checkpoint="never").timeline[0][1][1:] == (3, 6)
    assert result.makespan == 13
    assert simulate(actions, 2, costs=Costs(F=1, B=2), checkpoint="except_last").makespan == 9


@pytest.mark.parametrize("K", [4, 6, 8])
def test_a_communicator_per_link_runs_gpipe_as_fast_as_buffered_sends(K: int) -> None:
    """The runtime's layout (a communicator per directed pair of ranks) against the one before it (one per direction
    of rank order): with transfers that cost, a middle rank's receive from below no longer queues behind its own send
    above. gpipe with the loss inside then runs as with buffered sends (no queue at all), where it took up to 1.5×;
    1f1b, which alternates, never queued (each input posted when its F starts, as then)."""
    costs = Costs(F=1, B=2, transfer=1.0)
    for M in (K, 2 * K, 4 * K):
        gpipe, one_f_one_b = SCHEDULES["gpipe"].actions(K, M, 1), SCHEDULES["1f1b"].actions(K, M, 1)
        ideal = simulate(gpipe, K, 1, costs, nccl=False, ahead=True).makespan  # no queue, inputs posted alike
        assert simulate(gpipe, K, 1, costs).makespan <= 1.05 * ideal
        assert simulate(gpipe, K, 1, costs, layout="rank-order").makespan >= 1.15 * ideal
        assert (
            simulate(one_f_one_b, K, 1, costs, ahead=False).makespan
            == simulate(one_f_one_b, K, 1, costs, layout="rank-order", ahead=False).makespan
        )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_inputs_received_ahead_never_slow_a_schedule_and_hide_transfers(name: str) -> None:
    """An input whose receive is posted while the rank computes (``registry.inputs_ahead``) moves its bytes then: on
    the runtime's layout no schedule gets slower, and gpipe with the loss inside gains the most (each middle rank
    receives its inputs back to back), about 1.09× at one transfer per half a forward."""
    costs = Costs(F=1, B=2, I=1, W=1, transfer=0.5)
    for K in (2, 3, 4, 8):
        for M in (K, 2 * K, 4 * K):
            v, placement = SCHEDULES[name].v_min, SCHEDULES[name].placement
            if name.startswith("interleaved") and M % K:
                continue
            actions = executed(name, K, M, v)
            ahead, posted_late = (
                simulate(actions, K, v, costs, ahead=a, placement=placement).makespan for a in (True, False)
            )
            assert ahead <= posted_late + 1e-9, (K, M, ahead, posted_late)
            if name == "gpipe" and M >= K:
                assert posted_late >= 1.05 * ahead, (K, M, ahead, posted_late)


@pytest.mark.parametrize(("name", "K", "v"), [("gpipe", 3, 1), ("1f1b", 3, 1), ("interleaved-1f1b", 2, 2)])
def test_an_input_received_ahead_is_the_next_receive_from_its_rank(name: str, K: int, v: int) -> None:
    """At K = 2 interleaved, activations and gradients both come from the other rank: an input is received ahead
    only where no gradient from that rank comes between (gloo and NCCL pair a peer's messages in order)."""
    for r, ops in enumerate(SCHEDULES[name].actions(K, 2 * K, v)):
        ahead = inputs_ahead(ops, K, r, v)
        for before, later in ahead.items():
            assert ops[before].kind == ops[later].kind == "F"
            between = ops[before + 1 : later]
            gradients = [a for a in between if a.kind in ("B", "I") and (a.c, r) != (v - 1, K - 1)]
            assert not (gradients and (r + 1) % K == (r - 1) % K), (r, before, later, between)
            assert not [a for a in between if a.kind == "F" and (a.c, r) != (0, 0)], (r, before, later)
        if name != "interleaved-1f1b":  # every input after the rank's first, when nothing else comes from below
            assert len(ahead) == (2 * K - 1 if r else 0), (r, ahead)
    K2 = [inputs_ahead(ops, 2, r, 2) for r, ops in enumerate(SCHEDULES["interleaved-1f1b"].actions(2, 4, 2))]
    assert any(K2) and sum(map(len, K2)) < 2 * (2 * 4 - 1)  # some, not all: gradients from the same rank between
