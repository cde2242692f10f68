"""The schedule that chooses itself (``pipe.split.plan``): its grid, predictions that are the simulator's, the memory
model against hand counts, the budget, what host time and M do to the choice, and the check after traced steps."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_gpipe.pipe.schedule.registry import SCHEDULES, Action, chunk_of, executed, lookup, rank_of
from lightning_gpipe.pipe.schedule.simulator import Costs, simulate
from lightning_gpipe.pipe.split.plan import (
    Candidate,
    NoPlanFits,
    Prediction,
    Profile,
    candidates,
    check,
    describe,
    plan,
    predict,
)

MiB = 2**20


def uniform(L: int = 8, N: int = 16, **kw: float) -> Profile:
    """L equal layers: 10 ms of forward + backward, 64 MiB kept for the backward, 8 MiB out, 1 MiB of weights."""
    return Profile(N, [0.01] * L, [64 * MiB] * L, [8 * MiB] * L, [MiB] * L, input_bytes=8 * MiB, **kw)


def simulated(profile: Profile, p: Prediction, K: int) -> tuple[float, float]:
    """The step and bubble of ``p``'s candidate on ``p``'s split, simulated here from the profile by hand."""
    c, placement = p.candidate, lookup(p.candidate.schedule).placement
    costs, start = {}, 0
    for s, n in enumerate(p.balance):
        work = sum(profile.costs[start : start + n]) / c.M
        out = profile.output_bytes[start + n - 1] / c.M / profile.bandwidth
        back = (profile.output_bytes[start - 1] if start else profile.input_bytes) / c.M / profile.bandwidth
        start += n
        host, mh = profile.host_per_action, profile.message_host
        third = work / 3 + host
        costs[rank_of(s, K, placement), chunk_of(s, K, placement)] = Costs(
            F=third, B=2 * work / 3 + host, I=third, W=third, R=third, transfer=out, grad_transfer=back,
            send_host=mh, recv_host=mh,
        )  # fmt: skip
    result = simulate(executed(c.schedule, K, c.M, c.v), K, c.v, costs, checkpoint=c.checkpoint, placement=placement)
    return result.makespan, result.bubble


def test_the_grid_is_what_the_registry_accepts_without_fill_drain() -> None:
    K, N, Ms, vs = 3, 64, [3, 6, 7, 100], [1, 2, 3, 4]
    grid = candidates(K, N, Ms=Ms, vs=vs, L=9)
    accepted = set()
    for name, M, v, mode in itertools.product(SCHEDULES, Ms, vs, ["always", "except_last", "never"]):
        try:
            SCHEDULES[name].actions(K, M, v)
        except ValueError:
            continue
        if name != "fill-drain" and M <= N and v * K <= 9:
            accepted.add(Candidate(name, M, v, mode))  # type: ignore[arg-type]
    assert set(grid) == accepted and len(grid) == len(accepted)
    assert {c.schedule for c in grid} == set(SCHEDULES) - {"fill-drain"}
    assert Candidate("1f1b", 7, 1, "never") in grid
    assert Candidate("interleaved-1f1b", 7, 2, "never") not in grid  # 7 does not fill rounds of 7 / (7 // 3)
    assert Candidate("interleaved-1f1b", 6, 3, "never") in grid
    assert not [c for c in grid if c.M > N or c.v == 4]  # M = 100 > N; 4 · 3 stages > 9 layers
    assert {c.v for c in grid if c.schedule == "zb-v"} == {2}
    with pytest.raises(ValueError, match="choose it by name"):
        candidates(K, N, schedules=["gpipe", "fill-drain"])
    with pytest.raises(ValueError, match=re.escape("schedule='zb-h2' is not one of")):
        candidates(K, N, schedules=["zb-h2"])
    assert {c.M for c in candidates(2, 64)} == {2, 4, 8, 16}
    assert {c.M for c in candidates(4, 12)} == {4, 8}
    assert {c.v for c in candidates(1, 8)} == {1}


@pytest.mark.parametrize(
    "profile", [uniform(), uniform(bandwidth=2 * 1024 * MiB, message_host=1e-4, host_per_action=2e-4)]
)
def test_the_chosen_plan_is_the_fastest_and_every_prediction_is_the_simulators(profile: Profile) -> None:
    K = 2
    ranked = plan(profile, K)
    assert len(ranked) == len(candidates(K, profile.N, L=profile.L)) and all(p.fits for p in ranked)
    assert ranked[0].step == min(p.step for p in ranked)
    for p in ranked:
        assert sum(p.balance) == profile.L and len(p.balance) == p.candidate.v * K and min(p.balance) >= 1
        step, bubble = simulated(profile, p, K)
        assert p.step == pytest.approx(step, rel=1e-12) and p.bubble == pytest.approx(bubble, rel=1e-12)
    # no even split simulates shorter than the plan
    for c in candidates(K, profile.N, L=profile.L):
        even = Prediction(c, [profile.L // (c.v * K)] * (c.v * K), 0, 0, [])
        if sum(even.balance) == profile.L:
            assert ranked[0].step <= simulated(profile, even, K)[0] * (1 + 1e-12)


def test_peak_memory_counts_kept_graphs_boundaries_and_one_recompute() -> None:
    # gpipe, K = 2, M = 2 on 4 layers (2 a stage): 100 B kept per layer, 10 B out, a 6 B input, 1 B of weights a
    # layer and 3 more of state per weight byte (8 B a rank), all for the mini-batch.
    def peaks(N: int, mode: str, schedule: str = "gpipe") -> list[int]:
        profile = Profile(N, [1.0] * 4, [100] * 4, [10] * 4, [1] * 4, input_bytes=6)
        p = predict(profile, Candidate(schedule, 2, 1, mode), K=2)  # type: ignore[arg-type]
        assert p.balance == [2, 2]
        return p.peak_bytes

    # N = 2, micro-batches of one sample each: half of every figure.
    # never: rank 0 holds both graphs (F0 F1 B0 B1), 2 · 100; rank 1 runs F m B m, one graph.
    assert peaks(2, "never") == [8 + 200, 8 + 100]
    # always: rank 0 holds F1's input (3) while B0 recomputes its graph (100); rank 1 one graph at a time.
    assert peaks(2, "always") == [8 + 3 + 100, 8 + 100]
    # except_last: rank 0's F1 is not followed by B1, dropped as under always; rank 1 keeps both, one at a time
    assert peaks(2, "except_last") == [8 + 3 + 100, 8 + 100]
    # N = 3: micro-batches of 2 and 1 samples (the runtime's uneven split), each scaled by its own size.
    assert peaks(3, "never") == [8 + 200, 8 + round(200 * 2 / 3)]
    assert peaks(3, "always") == [8 + round(6 / 3 + 200 * 2 / 3), 8 + round(200 * 2 / 3)]
    # zb-h1: rank 1 runs F0 I0 F1 I1 W0 W1, and a graph stays until its W (rank 0 runs B0 B1: fuse_halves)
    assert executed("zb-h1", 2, 2)[1] == [Action(k, m) for k, m in zip("FIFIWW", [0, 0, 1, 1, 0, 1])]
    assert peaks(2, "never", "zb-h1") == [8 + 200, 8 + 200]
    assert peaks(2, "always", "zb-h1") == [8 + 3 + 100, 8 + 200]


def test_a_tight_budget_leaves_out_kept_graphs_and_the_plan_fits_it() -> None:
    profile, K = uniform(), 2
    free = plan(profile, K)
    kept = [p for p in free if p.candidate.checkpoint == "never"]
    assert free[0].candidate.checkpoint == "never"  # the fastest without a limit
    budget = min(max(p.peak_bytes) for p in kept) - 1
    ranked = plan(profile, K, budget)
    fitting = [p for p in ranked if p.fits]
    assert fitting and ranked[: len(fitting)] == fitting  # the ones that fit first
    assert max(ranked[0].peak_bytes) <= budget and ranked[0].step >= free[0].step
    assert all(p.candidate.checkpoint != "never" for p in fitting)
    assert [p.step for p in fitting] == sorted(p.step for p in fitting)
    gpipe = next(p for p in ranked if p.candidate == Candidate("gpipe", 16, 1, "never"))
    assert not gpipe.fits and max(gpipe.peak_bytes) > budget
    assert all(p.fits == (max(p.peak_bytes) <= budget) for p in ranked)


def test_a_budget_nothing_fits_is_one_clear_error() -> None:
    profile, K = uniform(), 2
    leanest = min(plan(profile, K), key=lambda p: max(p.peak_bytes))
    budget = max(leanest.peak_bytes) - 1
    with pytest.raises(NoPlanFits) as error:
        plan(profile, K, budget)
    message = str(error.value)
    assert f"{budget / MiB:.1f} MiB" in message and f"{max(leanest.peak_bytes) / MiB:.1f} MiB" in message
    assert str(leanest.candidate) in message and "raise the budget" in message
    assert isinstance(error.value, ValueError) and all(not p.fits for p in error.value.predictions)
    assert len(error.value.predictions) == len(candidates(K, profile.N, L=profile.L))
    with pytest.raises(NoPlanFits, match="re-materialization"):  # naming the mode left out
        plan(profile, K, budget, checkpoints=["never", "except_last"])


def test_host_time_per_action_favours_fewer_micro_batches_and_none_more() -> None:
    K, Ms = 2, [2, 4, 8, 16]
    assert plan(uniform(), K, Ms=Ms)[0].candidate.M == 16  # the bubble shrinks with M, nothing grows
    assert plan(uniform(host_per_action=0.002), K, Ms=Ms)[0].candidate.M == 2
    for search in (0, 8):
        steps = [
            plan(uniform(), K, Ms=[M], schedules=["1f1b"], checkpoints=["never"], searched=search)[0].step for M in Ms
        ]
        assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
        if search == 0:  # on the even split, (M + K − 1) / M of the work: GPipe's bubble
            assert steps == pytest.approx([0.04 * (M + K - 1) / M for M in Ms], rel=1e-12)
        else:  # a split the search found beats it where the bubble is large (the last stage's F B back to back)
            assert all(s <= 0.04 * (M + K - 1) / M * (1 + 1e-12) for s, M in zip(steps, Ms))
            assert steps[0] < 0.99 * 0.04 * (2 + K - 1) / 2


def test_check_is_quiet_within_ten_percent_and_names_a_better_candidate_beyond() -> None:
    ranked = plan(uniform(), 2)
    best = ranked[0]
    assert check(best, best.step * 1.09, ranked) is None and check(best, best.step * 0.91, ranked) is None
    slow = check(best, best.step * 2, ranked)
    assert slow is not None and str(best.candidate) in slow.message and "+100%" in slow.message
    named = [p for p in ranked if p.candidate != best.candidate and f"{p.candidate} would take" in slow.message]
    assert len(named) == 1 and named[0].actions < best.actions  # fewer actions to pay the missing time on
    assert slow.better == named[0]
    fast = check(best, best.step / 2, ranked)  # every cost halved: the order stands
    assert fast is not None and "-50%" in fast.message and "the choice stands" in fast.message and fast.better is None
    with pytest.raises(ValueError, match="positive number of seconds"):
        check(best, 0.0, ranked)


def test_describe_lists_the_top_candidates() -> None:
    ranked = plan(uniform(), 2)
    text = describe(ranked, top=7)
    lines = text.splitlines()
    assert len(lines) == 8 and lines[0].split()[:3] == ["schedule", "M", "v"]
    for p, line in zip(ranked[:7], lines[1:]):
        c = p.candidate
        assert line.split()[:4] == [c.schedule, str(c.M), str(c.v), c.checkpoint]
        assert f"{p.step * 1e3:.3f}" in line and " / ".join(f"{b / MiB:.1f}" for b in p.peak_bytes) in line
    assert len(describe(ranked).splitlines()) == 6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"costs": [1.0, 2.0]}, "Profile.activation_bytes has 3 entries"),
        ({"output_bytes": [1, -1, 1]}, r"Profile.output_bytes\[1\] is -1.0"),
        ({"N": 0}, "Profile.N is the mini-batch's number of samples"),
        ({"bandwidth": 0.0}, "bandwidth is 0.0 bytes/s"),
        ({"host_per_action": float("nan")}, "host_per_action is nan"),
    ],
)
def test_a_bad_profile_is_one_clear_error(change: dict, message: str) -> None:
    args = {
        "N": 4,
        "costs": [1.0] * 3,
        "activation_bytes": [1] * 3,
        "output_bytes": [1] * 3,
        "parameter_bytes": [1] * 3,
    }
    with pytest.raises(ValueError, match=message):
        Profile(**{**args, **change})


def test_a_v_is_split_for_its_own_shortest_step() -> None:
    # zb-v: rank 0 holds the first and the last stage, so balance.solve's cut (cheapest costliest stage) can load it
    # twice; the plan simulates the V itself.
    costs = [0.01 * c for c in range(1, 9)]
    profile, c = Profile(8, costs, [1] * 8, [1] * 8, [1] * 8), Candidate("zb-v", 4, 2, "except_last")
    quick, searched = predict(profile, c, 2, search=False), predict(profile, c, 2)
    every = [
        simulated(profile, Prediction(c, [b - a for a, b in zip((0, *cuts), (*cuts, 8))], 0, 0, []), 2)[0]
        for cuts in itertools.combinations(range(1, 8), 3)
    ]
    assert searched.step == min(every) < quick.step  # few enough splits to try them all
    # 40 layers into 8 stages: too many splits, the search moves one cut at a time from solve's
    profile = Profile(16, [0.01] * 39 + [0.2], [1] * 40, [1] * 40, [1] * 40)
    c = Candidate("zb-v", 8, 2, "never")
    quick, searched = predict(profile, c, 4, search=False), predict(profile, c, 4)
    assert quick.balance[-1] == 1 and quick.balance[0] > 1  # the heavy last layer alone, and more beside it on rank 0
    assert searched.step < 0.75 * quick.step and sum(searched.balance) == 40
    assert searched.step == pytest.approx(simulated(profile, searched, 4)[0], rel=1e-12)


def test_layer_bytes_counts_what_autograd_saves_once_without_weights() -> None:
    """Linear saves its input (not its weight), ReLU its output, the next Linear that same output again (counted once,
    at the ReLU); outputs and weights per layer, a weight tied to an earlier layer counted there; BatchNorm's running
    statistics as they were."""
    import torch
    from torch import nn

    from lightning_gpipe.pipe.split.plan import layer_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    model[4].weight = model[2].weight
    before = model[3].running_mean.clone()
    x = torch.randn(3, 4)
    activation, output, weights = layer_bytes(model, x)
    f = 4  # float32
    assert activation[:3] == [3 * 4 * f, 3 * 8 * f, 0.0]
    assert activation[3] > 0 and activation[4] == 3 * 8 * f  # BatchNorm's input and statistics; the last Linear's input
    assert output == [3 * 8 * f] * 5
    assert weights == [(32 + 8) * f, 0.0, (64 + 8) * f, 16 * f, 8 * f]  # layer 4: its bias only (the weight is 2's)
    assert torch.equal(model[3].running_mean, before)


def test_fixed_costs_make_small_micro_batches_dearer() -> None:
    """A layer timed at two micro-batch sizes: the line through them splits its cost into the part that grows with
    the samples and the part that does not; a fixed part favours fewer micro-batches, as a measured step does."""
    from lightning_gpipe.pipe.split.plan import fit_layer_costs

    costs, fixed = fit_layer_costs([0.003, 0.001], [0.010, 0.008], 8, 64, 64)
    assert costs == pytest.approx([0.008, 0.008]) and fixed == pytest.approx([0.002, 0.0])
    with pytest.raises(ValueError, match="two sample counts 0 < n_small < n_large"):
        fit_layer_costs([1.0], [1.0], 8, 8, 8)
    free = uniform(L=8, N=64)
    dear = Profile(64, free.costs, free.activation_bytes, free.output_bytes, free.parameter_bytes,
                   input_bytes=free.input_bytes, fixed_costs=[0.004] * 8)  # fmt: skip
    assert plan(free, 2, Ms=[2, 16], checkpoints=["never"])[0].candidate.M == 16
    assert plan(dear, 2, Ms=[2, 16], checkpoints=["never"])[0].candidate.M == 2


def test_a_split_is_priced_as_the_runtime_decides_it() -> None:
    """zb-h1's W holds what its ops' cost gate splits at the candidate's K and M (``split_cost.pays``): ops whose
    W does not pay leave zb-h1 1F1B's step and pay no split; ops that pay shorten it by what they move, less the split's
    cost. Without ``weight_ops`` W is a third of each layer's cost, as before the survey."""
    from dataclasses import replace

    from lightning_gpipe.pipe.schedule.split_cost import CONV_EXTRA, HOST_SECONDS, pays

    base, K, M = uniform(L=8, N=16), 2, 4
    zb, f1b = Candidate("zb-h1", M, 1, "never"), Candidate("1f1b", M, 1, "never")
    small = 0.1 * M * HOST_SECONDS  # a W of 0.1 host costs a micro-batch: it does not pay
    large = 0.002 * M  # 2 ms a micro-batch, a fifth of the layer's 10/3 ms backward share: it pays
    assert not pays(small / M, 0.0, K, M) and pays(large / M, 0.0, K, M)
    one_f = predict(base, f1b, K).step
    unsplit = predict(replace(base, weight_ops=[[(small, 0.0)]] * 8), zb, K)
    assert unsplit.step == pytest.approx(one_f, rel=1e-9)  # I holds all of B, W only its action's host time (none)
    split = predict(replace(base, weight_ops=[[(large, 0.0)]] * 8), zb, K)
    thirds = predict(base, zb, K)  # every layer's W a third of its cost: more moved than 2 ms
    assert thirds.step < split.step < one_f
    # A convolution's dearer halves on the CPU: at M = 8 no convolution pays at K = 2 (2 < 8 × CONV_EXTRA).
    conv, zb8, f1b8 = replace(base, weight_ops=[[(large, CONV_EXTRA)]] * 8), replace(zb, M=8), replace(f1b, M=8)
    assert pays(large / 8, 0.0, K, 8) and not pays(large / 8, CONV_EXTRA, K, 8)
    assert predict(conv, zb8, K).step == pytest.approx(predict(base, f1b8, K).step, rel=1e-9)
    with pytest.raises(ValueError, match=r"Profile\.weight_ops has 2 entries; give one per layer"):
        replace(base, weight_ops=[[], []])


def test_weight_ops_survey_what_a_split_could_defer_per_layer() -> None:
    """Linear, Conv1d and Embedding ops, each with its W's seconds on the whole sample and its extra share (a
    convolution's on the CPU); layers without such ops none; nothing routed, buffers as they were."""
    import torch
    from torch import nn

    from lightning_gpipe.pipe.run.weight_grad import weight_ops
    from lightning_gpipe.pipe.schedule.split_cost import CONV_EXTRA, CPU_THREAD_FLOPS

    torch.manual_seed(0)

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x.transpose(1, 2)).transpose(1, 2)

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.BatchNorm1d(5), Conv())
    before = model[3].running_mean.clone()
    ops = weight_ops(model, torch.randint(0, 10, (3, 5)))
    t = lambda flops: flops / (CPU_THREAD_FLOPS * torch.get_num_threads())  # noqa: E731
    assert ops[0] == [pytest.approx((t(3 * 5 * 8), 0.0))]  # one row of 8 per id
    assert ops[1] == [pytest.approx((t(2 * 15 * 64), 0.0))]  # 2 per weight element and input row
    assert ops[2] == [] and ops[3] == []
    assert ops[4] == [pytest.approx((t(2 * 3 * 5 * 8 * 8 * 3), CONV_EXTRA))]
    assert torch.equal(model[3].running_mean, before)
