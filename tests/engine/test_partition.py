"""Tests for the partitioner: the exact solver against brute force, balance checks, cost models and stage slicing."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe.split.balance import (
    costs_by_flops,
    costs_by_function,
    costs_by_parameters,
    costs_by_time,
    resolve_balance,
    solve,
    stage_layers,
    validate_balance,
)

pytestmark = pytest.mark.timeout(60)


def stage_costs(costs: list[float], counts: list[int]) -> list[float]:
    bounds = list(itertools.accumulate(counts, initial=0))
    return [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]


def brute_force(costs: list[int], K: int) -> int:
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), K - 1):
        bounds = [0, *cuts, L]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_solve_matches_brute_force() -> None:
    rng = random.Random(0)
    cases = 0
    for L in range(1, 10):
        for K in range(1, L + 1):
            for trial in range(12):
                # Small integer ranges make zeros and equal stage costs (ties) common; sums stay exact.
                high = (0, 1, 3, 100)[trial % 4]
                costs = [rng.randint(0, high) for _ in range(L)]
                counts = solve(costs, K)
                assert len(counts) == K and sum(counts) == L and all(n > 0 for n in counts)
                assert max(stage_costs(costs, counts)) == brute_force(costs, K), (costs, K, counts)
                assert solve(costs, K) == counts  # deterministic
                cases += 1
    assert cases == 12 * 45


def test_solve_float_costs() -> None:
    rng = random.Random(1)
    for _ in range(50):
        L = rng.randint(1, 8)
        K = rng.randint(1, L)
        costs = [rng.random() for _ in range(L)]
        counts = solve(costs, K)
        best = min(
            max(stage_costs(costs, [b - a for a, b in itertools.pairwise([0, *cuts, L])]))
            for cuts in itertools.combinations(range(1, L), K - 1)
        )
        assert max(stage_costs(costs, counts)) == pytest.approx(best, rel=1e-12)


def test_solve_hand_checked() -> None:
    assert solve([1, 1, 1, 1], 2) == [2, 2]
    assert max(stage_costs([10, 1, 1, 1], solve([10, 1, 1, 1], 2))) == 10
    assert solve([10, 1, 1, 1], 2) == [1, 3]
    assert solve([1, 2, 3, 4, 5], 1) == [5]
    assert solve([1, 2, 3, 4, 5], 5) == [1, 1, 1, 1, 1]
    assert solve([1, 1, 1, 1, 1, 1, 1, 1], 4) == [2, 2, 2, 2]
    assert solve([5, 5, 5, 5, 10, 10], 3) == [3, 2, 1]
    assert solve([0, 0, 0], 3) == [1, 1, 1]
    assert solve([3.5, 0.0, 1.5], 2) == [2, 1]  # the zero joins the first stage (tie)


def test_solve_tie_break_shortens_last_stage() -> None:
    # [2, 3] and [3, 2] both cost 3 at worst; the documented rule gives the surplus to the earlier stage.
    assert solve([1, 1, 1, 1, 1], 2) == [3, 2]
    assert solve([0, 0, 5], 2) == [2, 1]
    assert solve([5, 0, 0], 2) == [2, 1]
    assert solve([0, 0, 0, 0], 2) == [3, 1]


def test_solve_errors() -> None:
    with pytest.raises(ValueError, match=r"cannot split 3 layers into 4 stages: K must be ≤ L"):
        solve([1, 1, 1], 4)
    with pytest.raises(ValueError, match=r"cannot split 3 layers into 0 stages: K must be ≥ 1"):
        solve([1, 1, 1], 0)
    with pytest.raises(ValueError, match=r"cannot split 0 layers into 1 stages"):
        solve([], 1)
    with pytest.raises(ValueError, match=r"cost of layer 1 is -2"):
        solve([1, -2, 3], 2)
    with pytest.raises(ValueError, match=r"cost of layer 2 is nan"):
        solve([1, 2, float("nan")], 2)
    with pytest.raises(ValueError, match=r"cost of layer 0 is inf"):
        solve([float("inf"), 2], 2)
    with pytest.raises(TypeError, match=r"K must be an int"):
        solve([1, 2], 1.0)  # type: ignore[arg-type]


def test_validate_balance() -> None:
    assert validate_balance([2, 3], 5, 2) == [2, 3]
    assert validate_balance((1, 1, 1), 3, 3) == [1, 1, 1]
    with pytest.raises(ValueError, match=r"balance \[2, 2\] sums to 4 but the backbone has 5 layers; .* add up to 5"):
        validate_balance([2, 2], 5, 2)
    with pytest.raises(ValueError, match=r"balance \[2, 3\] has 2 entries but there are 3 stages"):
        validate_balance([2, 3], 5, 3)
    with pytest.raises(ValueError, match=r"balance\[1\] is 0; .*at least one layer"):
        validate_balance([5, 0], 5, 2)
    with pytest.raises(ValueError, match=r"balance\[0\] is -1"):
        validate_balance([-1, 6], 5, 2)
    with pytest.raises(TypeError, match=r"balance\[0\] is 2.5 \(float\); layer counts must be positive ints"):
        validate_balance([2.5, 2.5], 5, 2)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"balance\[0\] is True \(bool\)"):
        validate_balance([True, 4], 5, 2)


def test_resolve_balance_errors() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown balance 'params'; accepted values: .*'parameters', 'time'"):
        resolve_balance(seq, 2, "params")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"balance='time' profiles each layer on a sample micro-batch; pass sample="):
        resolve_balance(seq, 2, "time")
    with pytest.raises(ValueError, match=r"balance='flops' counts each layer's FLOPs on a sample micro-batch; pass s"):
        resolve_balance(seq, 2, "flops")
    with pytest.raises(TypeError, match=r"must be an nn.Sequential, got ModuleList"):
        resolve_balance(nn.ModuleList(seq), 2, "parameters")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"balance must be .*; got int"):
        resolve_balance(seq, 2, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sums to 2 but the backbone has 3 layers"):
        resolve_balance(seq, 2, [1, 1])
    with pytest.raises(ValueError, match=r"cannot split 3 layers into 4 stages"):
        resolve_balance(seq, 4, "parameters")


def test_resolve_balance_kinds() -> None:
    seq = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 1))
    assert resolve_balance(seq, 2, [3, 1]) == [3, 1]
    # Costs 110, 0, 110, 11: splitting after the ReLU or after the first Linear both leave 121 at worst.
    assert resolve_balance(seq, 2, "parameters") == [2, 2]
    assert resolve_balance(seq, 3, lambda i, layer: 100.0 if i == 3 else 1.0) == [2, 1, 1]
    counts = resolve_balance(seq, 2, "time", sample=torch.randn(4, 10))
    assert sum(counts) == 4 and len(counts) == 2
    # FLOPs 800, 0, 800, 80 (+ 40, 40, 40, 4 elements out): the last Linear joins the second one.
    assert resolve_balance(seq, 2, "flops", sample=torch.randn(4, 10)) == [2, 2]
    # Tied embedding and output layer: the table's parameters count at the embedding, its FLOPs at the output.
    tied = nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1000, bias=False))
    tied[3].weight = tied[0].weight
    assert resolve_balance(tied, 2, "parameters") == [1, 3]
    assert resolve_balance(tied, 2, "flops", sample=torch.arange(4)) == [3, 1]


def test_costs_by_parameters_counts_shared_once() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied: 40 elements, owned by the first user
    seq = nn.Sequential(embed, nn.ReLU(), nn.Linear(4, 4), head)
    assert costs_by_parameters(seq) == [40.0, 0.0, 20.0, 0.0]


def test_costs_by_parameters_lazy() -> None:
    with pytest.raises(ValueError, match=r"layer 0 \(LazyLinear\) has uninitialized lazy parameters"):
        costs_by_parameters(nn.Sequential(nn.LazyLinear(3)))


def test_costs_by_function() -> None:
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4))
    calls: list[tuple[int, type]] = []

    def fn(i: int, layer: nn.Module) -> float:
        calls.append((i, type(layer)))
        return float(i * 2)

    assert costs_by_function(seq, fn) == [0.0, 2.0, 4.0]
    assert calls == [(0, nn.Linear), (1, nn.ReLU), (2, nn.Linear)]


class ManyMatmuls(nn.Module):
    def __init__(self, n: int = 200) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, 64)
        for _ in range(self.n):
            h = torch.tanh(h @ self.weight)
        return h.reshape(x.shape)


class Fork(nn.Module):
    """Takes a tensor, returns (tensor, dict of tensors, long tensor)."""

    def forward(self, x: torch.Tensor) -> tuple:
        return x * 2, {"y": x + 1}, torch.arange(3)


class Join(nn.Module):
    def forward(self, xs: tuple) -> torch.Tensor:
        a, d, idx = xs
        assert not idx.is_floating_point() and not idx.requires_grad
        assert a.requires_grad and d["y"].requires_grad
        return a + d["y"]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_costs_by_time_orders_and_restores() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Dropout(0.1), ManyMatmuls(), nn.Linear(64, 8))
    seq.train()
    seq(torch.randn(16, 64)).sum().backward()  # give every parameter a .grad to be preserved
    before = snapshot(seq)
    grads = {n: p.grad.clone() for n, p in seq.named_parameters()}
    grad_objects = {n: p.grad for n, p in seq.named_parameters()}
    sample = torch.randn(16, 64)
    rng = torch.get_rng_state()

    # Medians of 7 sweeps: a busy machine's slow spells (one in a few sweeps) do not reach a median of 7.
    costs = costs_by_time(seq, sample, repeat=7, warmup=1)

    assert len(costs) == 5 and all(c >= 0 for c in costs)
    assert costs[3] > 5 * costs[0] and costs[3] > 5 * costs[4]
    after = snapshot(seq)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k  # includes running_mean/var and num_batches_tracked
    for n, p in seq.named_parameters():
        assert p.grad is grad_objects[n] and torch.equal(p.grad, grads[n]), n
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout's draws were taken from a forked stream


def test_costs_by_time_without_grads_and_in_no_grad() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad():
        costs = costs_by_time(seq, torch.randn(2, 4), repeat=1, warmup=0)
    assert len(costs) == 2
    assert all(p.grad is None for p in seq.parameters())


def test_costs_by_time_nested_and_inplace() -> None:
    seq = nn.Sequential(nn.Linear(4, 4), Fork(), Join(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    costs = costs_by_time(seq, x, repeat=2, warmup=0)
    assert len(costs) == 4
    inplace = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    x_before = x.clone()
    assert len(costs_by_time(inplace, x)) == 3
    assert torch.equal(x, x_before)  # the caller's sample is not overwritten by in-place layers
    # A layer whose outputs need no grad (integer tensor input, no parameters) is timed forward only.
    costs = costs_by_time(nn.Sequential(nn.Identity()), torch.arange(5), repeat=1, warmup=0)
    assert len(costs) == 1


def test_costs_by_time_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"repeat=0"):
        costs_by_time(nn.Sequential(nn.ReLU()), torch.zeros(1), repeat=0)


def linear_flops(n: int, layer: nn.Linear) -> int:
    return 2 * n * layer.in_features * layer.out_features


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_costs_by_flops_counts_linears_and_convolutions_exactly(device: str) -> None:
    """2·N·in·out per Linear, 2·out elements·in channels·kernel area per Conv2d, plus each layer's output elements;
    a layer without matmuls costs only what it outputs. The same on the meta device, where nothing is computed."""
    with torch.device(device):
        seq = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 5 * 5, 16), nn.Linear(16, 4)
        )
        sample = torch.randn(6, 3, 5, 5)
    conv = 2 * (6 * 8 * 5 * 5) * 3 * 3 * 3
    expected = [conv + 1200, 1200, 1200, linear_flops(6, seq[3]) + 6 * 16, linear_flops(6, seq[4]) + 6 * 4]
    assert costs_by_flops(seq, sample) == [float(c) for c in expected]


def test_costs_by_flops_restores_state_and_keeps_the_sample() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), Fork(), Join())
    x = torch.randn(4, 8)
    before, rng, x_before = snapshot(seq), torch.get_rng_state(), x.clone()
    costs = costs_by_flops(seq, x)
    assert costs[1] == linear_flops(4, seq[1]) + 32 and costs[2] == costs[3] == 32.0 and len(costs) == 6
    assert torch.equal(x, x_before)  # the in-place ReLU ran on a copy
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, snapshot(seq)[k]) for k, v in before.items())  # BatchNorm's running statistics too
    assert all(p.grad is None for p in seq.parameters())


class NeedsData(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[: int(x.sum().item()) % 2 + 1]  # a data-dependent shape: no data on the meta device


def test_costs_by_flops_names_the_layer_that_fails() -> None:
    with torch.device("meta"):
        seq = nn.Sequential(nn.Linear(2, 2), NeedsData())
        sample = torch.randn(3, 2)
    with pytest.raises(RuntimeError, match=r"balance='flops': layer 1 \(NeedsData\) failed on the meta device while"):
        costs_by_flops(seq, sample)


def test_stage_layers_default_names() -> None:
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)])
    balance = [3, 1, 3]
    stages = [stage_layers(seq, balance, k) for k in range(3)]
    assert [[name for name, _ in s] for s in stages] == [["0", "1", "2"], ["3"], ["4", "5", "6"]]
    owned = [layer for s in stages for _, layer in s]
    assert len(owned) == 7 and all(a is b for a, b in zip(owned, seq, strict=True))


def test_stage_layers_named_sequential() -> None:
    seq = nn.Sequential(
        OrderedDict(
            stem=nn.Conv2d(3, 4, 3),
            body=nn.ReLU(),
            pool=nn.AdaptiveAvgPool2d(1),
            flat=nn.Flatten(),
            head=nn.Linear(4, 2),
        )
    )
    assert [n for n, _ in stage_layers(seq, [1, 4], 0)] == ["stem"]
    assert [n for n, _ in stage_layers(seq, [1, 4], 1)] == ["body", "pool", "flat", "head"]
    assert stage_layers(seq, [1, 4], 1)[-1][1] is seq.head
    names = [n for k in range(3) for n, _ in stage_layers(seq, [2, 2, 1], k)]
    assert names == list(seq._modules)


def test_stage_layers_errors() -> None:
    seq = nn.Sequential(nn.ReLU(), nn.ReLU())
    with pytest.raises(IndexError, match=r"stage 2 does not exist: there are 2 stages, numbered 0 to 1"):
        stage_layers(seq, [1, 1], 2)
    with pytest.raises(IndexError, match=r"stage -1 does not exist"):
        stage_layers(seq, [1, 1], -1)
    with pytest.raises(ValueError, match=r"sums to 3 but the backbone has 2 layers"):
        stage_layers(seq, [1, 2], 0)


def test_shared_parameters_lists_weights_used_on_several_stages() -> None:
    from lightning_gpipe.pipe.split.balance import shared_parameters

    first, middle, last = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    middle.bias = first.bias  # tied between stages 0 and 1 only
    module = nn.Sequential(first, nn.Tanh(), middle, nn.Tanh(), last)
    assert shared_parameters(module, [2, 1, 2]) == [("0.weight", (0, 2)), ("0.bias", (0, 1))]
    assert shared_parameters(module, [3, 2]) == [("0.weight", (0, 1))]  # the bias is tied within stage 0
    assert shared_parameters(module, [5]) == []


def test_last_stage_scale_moves_layers_to_the_last_stage() -> None:
    """With the loss inside the pipeline the last stage does not recompute: its layers weigh 3/4 as much."""
    from lightning_gpipe.pipe.split.balance import solve

    costs = [1.0] * 7
    assert solve(costs, 2) == [4, 3]
    assert solve(costs, 2, last_stage_scale=0.75) == [3, 4]  # max(3, 4 × 0.75) = 3 < max(4, 3 × 0.75) = 4
    assert solve(costs, 3, last_stage_scale=0.5) == [2, 2, 3]
