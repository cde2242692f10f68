"""DeferredBatchNorm must track the running statistics of nn.BatchNorm on the whole mini-batch."""

from __future__ import annotations

import copy as copy_module
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.pipe.state.batchnorm import (
    DeferredBatchNorm,
    commit_deferred_batch_norm,
    convert_deferred_batch_norm,
    deferred_statistics,
    is_deferred,
    is_deferring,
    revert_deferred_batch_norm,
)
from lightning_gpipe.pipe.state.rematerialize import recomputing

pytestmark = pytest.mark.timeout(60)

C = 3
# (batch norm class, shape of one sample): 2-D input is what torchgpipe rejected.
LAYOUTS = {
    "1d-NC": (nn.BatchNorm1d, ()),
    "1d-NCL": (nn.BatchNorm1d, (5,)),
    "2d": (nn.BatchNorm2d, (4, 4)),
    "3d": (nn.BatchNorm3d, (2, 3, 3)),
}


def batch(n: int, sample: tuple[int, ...], seed: int) -> torch.Tensor:
    # A large offset next to unit spread: E[x²]−E[x]² loses every significant digit of the variance here.
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 1.0, 2.0]).view(1, C, *([1] * len(sample)))
    return 1000.0 + scale * torch.randn(n, C, *sample, generator=g)


def pair(kind: type[nn.Module], momentum: float | None) -> tuple[nn.Module, DeferredBatchNorm]:
    reference = kind(C, momentum=momentum)
    deferred = DeferredBatchNorm(C, momentum=momentum)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    deferred.load_state_dict(reference.state_dict(), strict=True)
    return reference, deferred


def pipeline_step(module: nn.Module, x: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    with deferred_statistics():
        outputs = [module(micro) for micro in torch.tensor_split(x, chunks)]
    commit_deferred_batch_norm(module)
    return outputs


def assert_same_stats(deferred: nn.Module, reference: nn.Module) -> None:
    torch.testing.assert_close(deferred.running_mean, reference.running_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(deferred.running_var, reference.running_var, rtol=1e-6, atol=0)
    assert deferred.num_batches_tracked.item() == reference.num_batches_tracked.item()


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
# 12 splits evenly into 1-4 micro-batches, 13 into none but one; both keep ≥ 2 samples per micro-batch, which
# (N, C) input needs: a single value per channel has no batch statistics.
@pytest.mark.parametrize("n", [12, 13], ids=["divisible", "uneven"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_running_stats_match_full_batch(layout: str, momentum: float | None, n: int, chunks: int) -> None:
    kind, sample = LAYOUTS[layout]
    reference, deferred = pair(kind, momentum)
    for step in range(3):
        x = batch(n, sample, seed=step)
        reference(x)
        pipeline_step(deferred, x, chunks)
        assert_same_stats(deferred, reference)
    assert deferred.num_batches_tracked.item() == 3


def test_naive_sum_of_squares_would_fail() -> None:
    # Proves the offset data has teeth: torchgpipe's fp32 E[x²]−E[x]² misses the variance that Chan's formula gets.
    x = batch(8, (4, 4), seed=0)
    dims = [0, 2, 3]
    n = x.numel() // C
    naive = torch.zeros(C)
    total, total_sq = torch.zeros(C), torch.zeros(C)
    for micro in torch.tensor_split(x, 4):
        total += micro.sum(dims)
        total_sq += micro.square().sum(dims)
    naive = total_sq / n - (total / n).square()
    exact = x.double().var(dims, correction=0)
    assert ((naive.double() - exact).abs() / exact).max() > 1e-3

    reference, deferred = pair(nn.BatchNorm2d, momentum=1.0)
    reference(x)
    pipeline_step(deferred, x, 4)
    assert_same_stats(deferred, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_are_per_micro_batch_and_differentiable(layout: str) -> None:
    kind, sample = LAYOUTS[layout]
    _, deferred = pair(kind, 0.1)
    x = batch(7, sample, seed=1).requires_grad_()
    outputs = pipeline_step(deferred, x, 3)

    weight = deferred.weight.detach().clone().requires_grad_()
    bias = deferred.bias.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    expected = [F.batch_norm(m, None, None, weight, bias, True, 0.0, deferred.eps) for m in x_ref.tensor_split(3)]
    for output, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(output, want, rtol=1e-6, atol=1e-6)

    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    torch.cat(outputs).mul(upstream).sum().backward()
    torch.cat(expected).mul(upstream).sum().backward()
    torch.testing.assert_close(deferred.weight.grad, weight.grad)
    torch.testing.assert_close(deferred.bias.grad, bias.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_recompute_repeats_output_without_double_counting() -> None:
    reference, deferred = pair(nn.BatchNorm2d, 0.1)
    x = batch(8, (4, 4), seed=3)
    micros = torch.tensor_split(x, 4)
    with deferred_statistics():
        with torch.no_grad():
            first = [deferred(m) for m in micros]
        with recomputing():
            again = [deferred(m) for m in micros]
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    deferred.commit()
    reference(x)
    assert_same_stats(deferred, reference)


def test_recompute_after_the_forward_phase_does_not_update() -> None:
    # The stage recomputes in the backward phase, outside deferred_statistics(): still no update there.
    reference, deferred = pair(nn.BatchNorm2d, 0.1)
    x = batch(8, (4, 4), seed=3)
    micros = torch.tensor_split(x, 4)
    with deferred_statistics(), torch.no_grad():
        first = [deferred(m) for m in micros]
    deferred.commit()
    with recomputing():
        again = [deferred(m) for m in micros]
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    reference(x)
    assert_same_stats(deferred, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outside_pipeline_is_plain_batch_norm(layout: str) -> None:
    kind, sample = LAYOUTS[layout]
    reference, deferred = pair(kind, 0.1)
    assert not is_deferring()
    for step in range(3):
        x = batch(6, sample, seed=10 + step)
        torch.testing.assert_close(deferred(x), reference(x), rtol=0, atol=0)
        assert_same_stats(deferred, reference)
    deferred.commit()  # nothing was deferred, so nothing to apply
    assert_same_stats(deferred, reference)

    reference.eval()
    deferred.eval()
    x = batch(6, sample, seed=20)
    with deferred_statistics():
        out = deferred(x)
    deferred.commit()
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert_same_stats(deferred, reference)


def test_without_running_stats_is_plain_batch_norm() -> None:
    reference = nn.BatchNorm2d(C, track_running_stats=False)
    deferred = DeferredBatchNorm(C, track_running_stats=False)
    x = batch(8, (4, 4), seed=4)
    with deferred_statistics():
        out = deferred(x)
    deferred.commit()
    torch.testing.assert_close(out, reference(x))
    assert deferred.running_mean is None and deferred.num_batches_tracked is None


def test_short_last_batch_commits_and_does_not_leak() -> None:
    reference, deferred = pair(nn.BatchNorm2d, 0.1)
    for step, (n, chunks) in enumerate([(8, 4), (3, 2), (8, 4), (1, 1)]):
        x = batch(n, (4, 4), seed=30 + step)
        reference(x)
        pipeline_step(deferred, x, chunks)
        assert_same_stats(deferred, reference)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn1d = nn.BatchNorm1d(4)
        self.bn3d = nn.BatchNorm3d(4, momentum=None, eps=1e-3)
        self.frozen = nn.BatchNorm2d(4, affine=False).eval()
        self.sync = nn.SyncBatchNorm(4)
        self.group = nn.GroupNorm(2, 4)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.ReLU(), Block()))


def test_convert_and_revert_nested() -> None:
    net = model()
    with torch.no_grad():  # non-default buffers, so a load that silently skipped them would show
        for bn in net.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_mean.uniform_()
                bn.num_batches_tracked.fill_(5)
    keys = list(net.state_dict())
    original = {k: v.clone() for k, v in net.state_dict().items()}
    tensors = {n: id(t) for n, t in [*net.named_parameters(), *net.named_buffers()]}
    layers = {name: (type(m), m) for name, m in net.named_modules()}
    block = net[2][1]

    converted = convert_deferred_batch_norm(net)
    assert converted is net
    # Deferred in place: every layer keeps its class and identity (so references held elsewhere still hold it).
    assert {name: (type(m), m) for name, m in net.named_modules()} == layers
    norms = [net[1], block.bn1d, block.bn3d, block.frozen, block.sync]
    assert all(is_deferred(m) for m in norms) and not is_deferred(block.group) and not block.frozen.training
    assert list(net.state_dict()) == keys
    assert {n: id(t) for n, t in [*net.named_parameters(), *net.named_buffers()]} == tensors
    model().load_state_dict(net.state_dict(), strict=True)
    net.load_state_dict(original, strict=True)
    assert convert_deferred_batch_norm(net) is net and len(net[1]._forward_pre_hooks) == 1  # idempotent

    reverted = revert_deferred_batch_norm(net)
    assert reverted is net
    assert {name: (type(m), m) for name, m in net.named_modules()} == layers
    assert not any(is_deferred(m) or m._forward_pre_hooks or m._forward_hooks for m in norms)
    assert list(net.state_dict()) == keys
    assert {n: id(t) for n, t in [*net.named_parameters(), *net.named_buffers()]} == tensors
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, original[key], rtol=0, atol=0)


def test_convert_batch_norm_given_directly() -> None:
    bn = nn.BatchNorm1d(C, momentum=0.3).eval()
    assert DeferredBatchNorm.convert_deferred_batch_norm(bn) is bn and is_deferred(bn)
    assert (bn.momentum, bn.training) == (0.3, False)
    assert revert_deferred_batch_norm(bn) is bn and not is_deferred(bn)
    deferred = DeferredBatchNorm(C)
    assert is_deferred(deferred) and convert_deferred_batch_norm(deferred) is deferred
    assert type(revert_deferred_batch_norm(deferred)) is nn.BatchNorm2d


def test_copies_stay_deferred() -> None:
    # A deep copy or a pickle of a deferred layer defers too, with its own accumulators.
    reference, bn = nn.BatchNorm2d(C), nn.BatchNorm2d(C)
    convert_deferred_batch_norm(bn)
    for copy in (copy_module.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        assert type(copy) is nn.BatchNorm2d and is_deferred(copy)
        pipeline_step(copy, batch(8, (4, 4), seed=7), 4)
        assert bn.num_batches_tracked.item() == 0
        reference.load_state_dict(bn.state_dict())
        reference(batch(8, (4, 4), seed=7))
        assert_same_stats(copy, reference)


@pytest.mark.parametrize(("ndim", "kind"), [(None, nn.BatchNorm2d), (3, nn.BatchNorm1d), (5, nn.BatchNorm3d)])
def test_revert_directly_built_uses_seen_input(ndim: int | None, kind: type[nn.Module]) -> None:
    deferred = DeferredBatchNorm(C)
    if ndim is not None:
        deferred(batch(4, (2,) * (ndim - 2), seed=5))
    assert type(revert_deferred_batch_norm(deferred)) is kind


def test_commit_without_accumulation_changes_nothing() -> None:
    _, deferred = pair(nn.BatchNorm2d, None)
    before = {k: v.clone() for k, v in deferred.state_dict().items()}
    deferred.commit()
    for key, value in deferred.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    pipeline_step(deferred, batch(8, (4, 4), seed=6), 2)
    after_one = {k: v.clone() for k, v in deferred.state_dict().items()}
    deferred.commit()  # the step's accumulators were reset by the first commit
    for key, value in deferred.state_dict().items():
        torch.testing.assert_close(value, after_one[key], rtol=0, atol=0)
    assert after_one["num_batches_tracked"].item() == before["num_batches_tracked"].item() + 1

    fresh = DeferredBatchNorm(C)
    fresh.commit()
    assert fresh.num_batches_tracked.item() == 0
    torch.testing.assert_close(fresh.running_var, torch.ones(C), rtol=0, atol=0)


def test_rejects_one_dimensional_input() -> None:
    with pytest.raises(ValueError, match="at least 2D"):
        DeferredBatchNorm(C)(torch.randn(C))


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_not_deferred_statistics_update_once_per_micro_batch_whatever_the_recompute(mode: str) -> None:
    """``deferred_batch_norm=False``: BatchNorm updates its running statistics once per micro-batch, as M calls of the
    plain module do, although its kernel writes them without bumping the version counter that tells the stage which
    buffers a recompute must replay."""
    from lightning_gpipe.pipe import GPipeStage

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    stage = GPipeStage(copy_module.deepcopy(plain), chunks=3, balance=[4], checkpoint=mode, deferred_batch_norm=False)
    x = torch.randn(9, 4, dtype=torch.float64)
    for part in x.split(3):
        plain(part)
    out = stage(x)
    out.square().sum().backward()
    stage.backward()
    for name, ref in plain.named_buffers():
        assert torch.equal(stage.get_buffer(name), ref), (mode, name)
