"""Which ops zb-h1 splits (``weight_grad.split_pays``): those whose W pays for the split, per weight, all step."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.run.weight_grad import SPLIT_EVERY_OP, WeightGrads, split_pays
from lightning_gpipe.pipe.schedule import split_cost
from lightning_gpipe.pipe.schedule.split_cost import CONV_EXTRA, CPU_THREAD_FLOPS, HOST_SECONDS
from tests.helpers.launch import run_distributed


def test_split_pays_where_the_w_it_moves_outweighs_the_split_s_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op splits when 2(K − 1)·t_W exceeds M times the split's cost per op, t_W from the device's rate in the
    products' dtype (the CPU's threads; a GPU's multiprocessors and clock, its tensor cores for bf16 and TF32); a
    convolution on the CPU when what remains after its dearer halves does; every op where SPLIT_EVERY_OP is set."""
    monkeypatch.delenv(SPLIT_EVERY_OP, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = torch.device("cpu")
    edge = 8 * HOST_SECONDS * CPU_THREAD_FLOPS / 2  # K = 2, M = 8: a linear's W must exceed 4 × the split's cost
    assert split_pays(edge * 1.01, False, cpu, 2, 8) and not split_pays(edge * 0.99, False, cpu, 2, 8)
    assert split_pays(edge * 0.99, False, cpu, 4, 8)  # 2(K − 1) = 6: a third of it pays at K = 4
    assert not split_pays(1e15, True, cpu, 2, 8)  # 2 − 8 × CONV_EXTRA < 0: no convolution pays at K = 2, M = 8
    conv_edge = 8 * HOST_SECONDS * CPU_THREAD_FLOPS / (2 * 7 - 8 * CONV_EXTRA)
    assert split_pays(conv_edge * 1.01, True, cpu, 8, 8) and not split_pays(conv_edge * 0.99, True, cpu, 8, 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # the same W in a quarter of the time
    assert not split_pays(edge * 1.01, False, cpu, 2, 8) and split_pays(edge * 4.04, False, cpu, 2, 8)
    # An H100's properties: 132 multiprocessors at 1.98 GHz, 67 TFLOP/s on its FP32 units.
    props = SimpleNamespace(multi_processor_count=132, clock_rate=1_980_000, major=9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    gpu = torch.device("cuda", 0)
    gpu_edge = 8 * HOST_SECONDS * (132 * 1.98e9 * 256) / 2
    assert split_pays(gpu_edge * 1.01, False, gpu, 2, 8) and not split_pays(gpu_edge * 0.99, False, gpu, 2, 8)
    assert split_pays(gpu_edge * 1.01, True, gpu, 2, 8)  # cuDNN computes the halves apart anyway
    bf16 = torch.bfloat16
    assert not split_pays(gpu_edge * 15.9, False, gpu, 2, 8, bf16) and split_pays(
        gpu_edge * 16.1, False, gpu, 2, 8, bf16
    )
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # a property of torch's (monkeypatch cannot undo it)
    try:
        assert not split_pays(gpu_edge * 7.9, False, gpu, 2, 8) and split_pays(gpu_edge * 8.1, False, gpu, 2, 8)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    monkeypatch.setenv(SPLIT_EVERY_OP, "1")
    assert split_pays(1.0, True, cpu, 2, 8) and split_pays(1.0, False, gpu, 2, 8)


class BigAndSmall(nn.Module):
    """A small linear used twice, a norm, and a big vocabulary-like projection."""

    def __init__(self) -> None:
        super().__init__()
        self.small, self.norm, self.big = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.norm(self.small(torch.tanh(self.small(x)))))


def test_with_a_shape_only_the_ops_that_pay_split_and_the_others_lose_their_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """K = 2, M = 3 with the host's cost set between the two linears' W: the big one defers in every micro-batch, the
    small one (used twice) in none, its hooks gone after the first forward; the gradients are autograd's bit for bit,
    micro-batches' W run late and out of order as zb-h1 runs them."""
    monkeypatch.delenv(SPLIT_EVERY_OP, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    rows = 5 * 7
    small_w, big_w = 2 * rows * 8 * 8, 2 * rows * 8 * 512
    host = (small_w + big_w) / 2 * 2 / 3 / CPU_THREAD_FLOPS  # K = 2, M = 3: gain 2 / 3
    monkeypatch.setattr(split_cost, "HOST_SECONDS", host)
    torch.manual_seed(0)
    plain = BigAndSmall().double()
    split = copy.deepcopy(plain)
    xs = [torch.randn(5, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(m)) for m in range(3)]
    for x in xs:
        plain(x).square().mean().backward()
    weights = WeightGrads(split, (2, 3))
    assert len(weights._handles) == 2
    for m, x in enumerate(xs):
        with weights.deferring(m):
            y = split(x)
        y.square().mean().backward()
        assert len(weights._pending[m]) == 1  # the big projection's W waits
        assert split.small.weight.grad is not None and (m > 0 or split.big.weight.grad is None)
        assert list(weights._handles) == [id(split.big)]  # the small linear's hooks went after the first forward
        if m:
            weights.run(m - 1)
    weights.run(2)
    weights.close()
    for (n, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


def _stage_worker(rank: int, world_size: int, host_flops: float) -> dict[str, Any]:
    """K = 2, M = 4, two steps of ``BigAndSmall`` split [1, 2] (the small linear on rank 0; rank 1: the shared small
    linear and the big projection) under zb-h1 with the engine's rule, then 1F1B: gradients, and per W, the closures
    it ran (lists: a tensor cannot outlive its rank in the results' queue); per step, the weights split and met."""
    import os

    os.environ.pop(SPLIT_EVERY_OP, None)
    split_cost.HOST_SECONDS = host_flops / CPU_THREAD_FLOPS
    torch.set_num_threads(1)
    ran: list[int] = []
    decided: list[tuple[int, int]] = []
    run, close = WeightGrads.run, WeightGrads.close

    def counted_run(self: WeightGrads, m: int) -> None:
        ran.append(len(self._pending.get(m, [])))
        run(self, m)

    def recorded_close(self: WeightGrads) -> None:
        if self._handles or self._pays:
            decided.append(self.decided)
        close(self)

    WeightGrads.run, WeightGrads.close = counted_run, recorded_close  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for schedule in ("zb-h1", "1f1b"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), BigAndSmall()).double()
        stage = GPipeStage(model, chunks=4, balance=[1, 1], checkpoint="except_last")
        grads = []
        for step in range(2):
            x = torch.randn(4 * (step + 2), 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            stage.zero_grad(set_to_none=True)
            stage.forward_backward(x, lambda y, m: y.square().mean(), schedule=schedule)
            grads.append({n: p.grad.tolist() for n, p in stage.named_parameters()})  # tensors can't outlive the rank
        out[schedule] = grads
    return {**out, "ran": ran, "decided": decided}


@pytest.mark.timeout(120)
def test_the_engine_splits_only_what_pays_and_is_the_same_run_as_1f1b() -> None:
    """With the host's cost between the small and the big linear's W (K = 2, M = 4: 2(K − 1)·t_W > M·HOST_SECONDS),
    rank 1 defers the big projection's W in every split micro-batch and nothing else; gradients are 1F1B's bit for
    bit. With the cost above both, nothing splits, and zb-h1 still runs as 1F1B does."""
    rows = 2 * 7  # a micro-batch of the first step: 2 samples × 7
    small_w, big_w = 2 * rows * 8 * 8, 2 * rows * 8 * 512
    for host, deferred in (((small_w + big_w) / 4, 1), (big_w, 0)):  # 2·t / 4 > host: the big one, then neither
        results = run_distributed(_stage_worker, 2, host, timeout=100)
        assert results[0]["ran"] == [] and results[0]["decided"] == []  # rank 0's W's follow their I's: fused
        last = results[1]
        assert last["decided"] == [(deferred, 2), (deferred, 2)]  # per step: the big linear, of the two weights met
        assert len(last["ran"]) == 2 * 4 and set(last["ran"]) == {deferred}  # one closure per W, or none
        for got, want in zip(last["zb-h1"], last["1f1b"]):
            assert got == want  # bit for bit: float64 values as Python floats


@pytest.mark.parametrize("K", [2, 3, 4])
def test_the_simulated_zb_h1_step_shrinks_by_2_k_minus_1_times_the_w_moved(K: int) -> None:
    """``split_pays``' premise: with a share f of W moved out of I (F = 1, I + W = 2), zb-h1's step is 1F1B's less
    2(K − 1)·f, for M = 8."""
    from lightning_gpipe.pipe.schedule.registry import SCHEDULES, executed
    from lightning_gpipe.pipe.schedule.simulator import Costs, simulate

    one_f_one_b = simulate(SCHEDULES["1f1b"].actions(K, 8), K, 1, Costs(F=1, B=2)).makespan
    actions = executed("zb-h1", K, 8)
    for f in (0.0, 0.25, 0.5, 1.0):
        step = simulate(actions, K, 1, Costs(F=1, B=2, I=2 - f, W=f)).makespan
        assert step == pytest.approx(one_f_one_b - 2 * (K - 1) * f), f
