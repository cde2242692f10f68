"""A stage's layers sharded with FSDP2 over its data-parallel replicas (pipe.dp.fsdp): the same gradients as one
device for every schedule and the loss inside or outside, each parameter held as a shard, and one all-gather and one
reduce-scatter per layer per step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.dp.fsdp import ShardedLayers
from tests.helpers.launch import counted_fsdp_collectives, run_distributed

N, STEPS, LR = 7, 2, 0.1  # 7 samples a replica: M = 3 uneven micro-batches (3, 2, 2)


def build() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [(8, 16), (16, 16), (16, 15), (15, 4)]  # 15: a dimension the 2 shards cannot split evenly
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(widths):
        layers += [nn.Linear(a, b), nn.Tanh()] if i < len(widths) - 1 else [nn.Linear(a, b)]
    return nn.Sequential(*layers).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """Each replica's batch (different data per replica): inputs and targets, replica first."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, N, 8, generator=g, dtype=torch.float64)
    return x, torch.randn(2, N, 4, generator=g, dtype=torch.float64)


def _worker(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "pipeline"))
    v = case.get("v", 1)
    stage = GPipeStage(
        build(),
        chunks=3,
        balance=[4, 3] if v == 1 else [2, 2, 2, 1],
        checkpoint=case["checkpoint"],
        group=mesh["pipeline"].get_group(),
        virtual_stages=v,
    )
    sharded = ShardedLayers(stage.children(), mesh["data_parallel"])
    plain, (xs, ys) = build(), data()
    x, y = xs[mesh["data_parallel"].get_local_rank()], ys[mesh["data_parallel"].get_local_rank()]
    worst = 0.0
    with counted_fsdp_collectives() as calls:
        for _ in range(STEPS):
            sharded.begin()
            sizes = stage.micro_batch_sizes(x)
            starts = [sum(sizes[:m]) for m in range(len(sizes))]

            def loss_fn(out: torch.Tensor, m: int, at: list[int] = starts, n: list[int] = sizes) -> torch.Tensor:
                return ((out - y[at[m] : at[m] + n[m]]) ** 2).sum() / N

            if case["schedule"] is None:  # the loss outside the pipeline, on the whole output
                out = stage(x)
                if stage.is_last:
                    (((out - y) ** 2).sum() / N).backward()
                stage.backward(drained=sharded.reduce)
            else:
                stage.forward_backward(x, loss_fn, schedule=case["schedule"], drained=sharded.reduce)
            plain.zero_grad()
            (sum(((plain(xs[r]) - ys[r]) ** 2).sum() / N for r in range(2)) / 2).backward()
            named = dict(plain.named_parameters())
            for name, p in stage.named_parameters():
                assert isinstance(p, DTensor) and p.to_local().shape[0] <= math.ceil(p.shape[0] / 2), name  # dim 0
                worst = max(worst, (p.grad.full_tensor() - named[name].grad).abs().max().item())
            with torch.no_grad():
                for p in [*stage.parameters(), *plain.parameters()]:
                    p -= LR * p.grad
                    p.grad = None
        weights = max(
            (p.full_tensor() - dict(plain.named_parameters())[n]).abs().max().item()
            for n, p in stage.named_parameters()
        )
    return {"worst_grad": worst, "weights": weights, "calls": calls, "units": len(sharded.units)}


CASES = [
    {"schedule": None, "checkpoint": "except_last"},
    {"schedule": "gpipe", "checkpoint": "always"},
    {"schedule": "1f1b", "checkpoint": "except_last"},
    {"schedule": "zb-h1", "checkpoint": "except_last"},
    {"schedule": "interleaved-1f1b", "checkpoint": "never", "v": 2},
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[f"{c['schedule'] or 'loss_outside'}-{c['checkpoint']}" for c in CASES])
def test_sharded_stages_are_the_plain_run_with_one_gather_and_one_reduce_per_layer(case: dict[str, Any]) -> None:
    results = run_distributed(_worker, 4, case, timeout=100)
    for rank, r in enumerate(results):
        assert r["worst_grad"] < 1e-12 and r["weights"] < 1e-12, (rank, r)
        # Per step, each sharded layer gathered once for all M micro-batches and reduced once (not M times).
        assert r["units"] >= 1 and r["calls"] == {
            "all_gather": STEPS * r["units"],
            "reduce_scatter": STEPS * r["units"],
        }


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _adam_worker(rank: int, world_size: int) -> dict[str, float]:
    """Adam on the shards under zb-h1 against Adam on the plain model, and what each rank holds."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "pipeline"))
    torch.manual_seed(0)
    wide = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 4)).double()
    plain = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 4)).double()
    plain.load_state_dict(wide.state_dict())
    stage = GPipeStage(wide, chunks=3, balance=[3, 2], group=mesh["pipeline"].get_group())
    whole = sum(p.numel() * p.element_size() for p in stage.parameters())  # the unsharded stage's parameters
    sharded = ShardedLayers(stage.children(), mesh["data_parallel"])
    optimizer, reference = torch.optim.Adam(stage.parameters(), lr=1e-2), torch.optim.Adam(plain.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(2, N, 64, generator=g, dtype=torch.float64), torch.randn(2, N, 4, generator=g).double()
    d = mesh["data_parallel"].get_local_rank()
    for _ in range(3):
        sharded.begin()
        sizes = stage.micro_batch_sizes(xs[d])
        starts = [sum(sizes[:m]) for m in range(len(sizes))]

        def loss_fn(out: torch.Tensor, m: int, at: list[int] = starts, n: list[int] = sizes) -> torch.Tensor:
            return ((out - ys[d][at[m] : at[m] + n[m]]) ** 2).sum() / N

        stage.forward_backward(xs[d], loss_fn, schedule="zb-h1", drained=sharded.reduce)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients' shards stay allocated, as in a training loop
        (sum(((plain(xs[r]) - ys[r]) ** 2).sum() / N for r in range(2)) / 2).backward()
        reference.step()
        reference.zero_grad()
    named = dict(plain.named_parameters())
    held = sum(_local_bytes(p) + _local_bytes(p.grad) for p in stage.parameters())
    held += sum(_local_bytes(t) for state in optimizer.state.values() for t in state.values())
    return {
        "weights": max((p.full_tensor() - named[n]).abs().max().item() for n, p in stage.named_parameters()),
        "held_over_ddp": held / (4 * whole),  # a replica holds parameters, gradients and Adam's two moments whole
    }


@pytest.mark.timeout(120)
def test_adam_on_the_shards_is_the_plain_run_and_each_rank_holds_about_half() -> None:
    for rank, r in enumerate(run_distributed(_adam_worker, 4, timeout=100)):
        assert r["weights"] < 1e-12, (rank, r)
        assert r["held_over_ddp"] <= 0.55, (rank, r)


def _sharing_worker(rank: int, world_size: int) -> str:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    try:
        ShardedLayers([first, second], init_device_mesh("cpu", (1,)))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_layers_sharing_a_weight_are_refused() -> None:
    """Two FSDP units over one weight would each gather it and reduce its gradient (silently wrong): refused."""
    (message,) = run_distributed(_sharing_worker, 1, timeout=50)
    assert "layer 1 (Linear) shares a parameter of shape (4, 4) with layer 0" in message, message


class _Branchy(nn.Module):
    """A layer whose second projection only some batches reach."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def _skipped_branch_worker(rank: int, world_size: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (2,))
    layer, plain = _Branchy(), _Branchy()
    sharded = ShardedLayers([layer], mesh)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sharded.begin()
    layer(x[rank], use_b=rank == 0).sum().backward()
    sharded.reduce()
    # DDP's mean: replica 1 contributes zeros to b's gradient.
    (sum(plain(x[r], use_b=r == 0).sum() for r in range(2)) / 2).backward()
    named = dict(plain.named_parameters())
    return {n: (p.grad.full_tensor() - named[n].grad).abs().max().item() for n, p in layer.named_parameters()}


@pytest.mark.timeout(60)
def test_a_branch_one_replica_skipped_is_reduced_with_zeros_from_it() -> None:
    """Before: the replicas reduce-scattered different sizes (gloo: "Received data size doesn't match expected size",
    the process aborted; NCCL would hang or mix buffers). Now they agree first on which gradients exist."""
    for r in run_distributed(_skipped_branch_worker, 2, timeout=50):
        assert set(r) == {"a.weight", "a.bias", "b.weight", "b.bias"} and max(r.values()) < 1e-12, r


def _hooks_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    mesh = init_device_mesh("cpu", (2,))
    seq, plain = build(), build()
    order: list[str] = []
    seq[0].register_forward_pre_hook(lambda *_: order.append("user pre, before sharding"))
    sharded = ShardedLayers(seq, mesh)
    seq[0].register_forward_hook(lambda *_: order.append("user post, after sharding"))
    keys_before = [list(seq[0]._forward_pre_hooks), list(seq[0]._forward_hooks)]
    fired = {"fsdp": 0}
    real = FSDPParamGroup.pre_forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        fired["fsdp"] += 1
        return real(self, *args, **kwargs)

    FSDPParamGroup.pre_forward = counted  # type: ignore[method-assign]
    xs, ys = data()
    out: dict[str, Any] = {}
    try:
        with counted_fsdp_collectives() as calls:
            sharded.begin()
            out["sharded_until_first_forward"] = all(isinstance(p, DTensor) for p in seq.parameters())
            for m in range(3):  # three micro-batches, each forward and backward
                (seq(xs[rank][m::3]) - ys[rank][m::3]).square().sum().backward()
            out["fsdp_hooks_in_step"] = fired["fsdp"]
            out["gathers"] = calls["all_gather"]
            sharded.reduce()
        out["keys_after"] = [list(seq[0]._forward_pre_hooks), list(seq[0]._forward_hooks)] == keys_before
        out["sharded_after"] = all(isinstance(p, DTensor) for p in seq.parameters())
        sum((plain(xs[r]) - ys[r]).square().sum() for r in range(2)).div(2).backward()
        named = dict(plain.named_parameters())
        grads = [(p.grad.full_tensor() - named[n].grad).abs().max().item() for n, p in seq.named_parameters()]
        out["grads"] = max(grads)
        with torch.no_grad():  # a call between steps: FSDP2's hooks gather
            between = seq(xs[rank])
        out["fsdp_hooks_between"] = fired["fsdp"]
        out["between"] = (between - plain(xs[rank])).abs().max().item()
    finally:
        FSDPParamGroup.pre_forward = real  # type: ignore[method-assign]
    out["order"] = order
    return out


@pytest.mark.timeout(60)
def test_within_a_step_fsdp2s_hooks_are_off_and_between_steps_on_again() -> None:
    """The default policy holds each layer whole for the step: FSDP2's forward hooks would only cost host time at every
    micro-batch (1.2× a CPU step's forward and backward). Off from the stage's first forward to the reduction, every
    layer gathered once at that first forward (the parameters stay the optimizer's shards until then); after it the
    hooks are back in their places among the user's, and a call between steps gathers as FSDP2 does."""
    for r in run_distributed(_hooks_worker, 2, timeout=50):
        assert r["sharded_until_first_forward"] and r["sharded_after"], r
        assert r["fsdp_hooks_in_step"] == 0 and r["gathers"] == 4, r  # 4 layers with parameters
        assert r["fsdp_hooks_between"] == 4 and r["between"] < 1e-12, r
        assert r["keys_after"], r
        # Once in the step's first forward and once between steps, in each hook's place: the user's pre-hook before
        # sharding, their forward hook after it.
        assert r["order"] == ["user pre, before sharding", "user post, after sharding"] * 4, r
        assert r["grads"] < 1e-12, r
