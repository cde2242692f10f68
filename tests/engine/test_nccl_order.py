"""NCCL's point-to-point rules on CPU (``nccl_order``): the check catches a cycle, and no path of the engine has one.

Under ``GPIPE_NCCL_SEMANTICS=1`` each group's transfers run one at a time in posting order and a send ends only
when its receive runs, as large NCCL transfers do. The negative tests show the check stops the traffic that
would hang on GPUs (activations and gradients on one group); the matrix runs every path of the engine -- the
fill/drain phases with each output mode, the loss inside under every schedule, forward-only evaluation -- at
K = 2, 3, 4 and at pp = 2 × dp = 2, traced and not, and checks the gradients against the plain model so a run that
"passed" also computed the right thing.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.comm.groups import data_timeout, link_groups
from lightning_gpipe.pipe.comm.nccl_order import ENV, OrderedP2P, P2POrderError
from lightning_gpipe.pipe.comm.transport import Transport
from lightning_gpipe.pipe.schedule.registry import SCHEDULES as REGISTRY
from tests.helpers.launch import run_distributed

# One chunk per rank (interleaving runs under these rules in test_interleaved.py).
SCHEDULES = tuple(name for name, spec in REGISTRY.items() if spec.accepts(1))

TOL = 1e-6
D = 6


def _ordered() -> None:
    os.environ[ENV] = "1"


def _one_group_traffic(rank: int, world_size: int, split: bool) -> str:
    """The loss-inside pattern of K = 2 (stage 0: send a0, send a1, recv g0; stage 1: recv a0, send g0, recv a1)."""
    _ordered()
    world = dist.group.WORLD
    assert world is not None
    # A hang is caught after the timeout: short where one is expected, long where a loaded machine must not fake one.
    timeout = timedelta(seconds=30 if split else 4)
    links = link_groups(world, rank, 2, timeout) if split else None
    tr = Transport(world, device=torch.device("cpu"), timeout=timeout, links=links)
    a = [torch.full((64,), float(m)) for m in range(2)]
    try:
        if rank == 0:
            metas = [tr.send(1, a[m])[0] for m in range(2)]
            g0, _ = tr.post_recv(1, "g0", expect=[metas[0]]).wait()
            tr.wait_sends()
            return f"g0={g0[0][1].item()}"
        x0, _ = tr.recv(0, "a0")
        tr.send(0, [x0 * 2])
        x1, _ = tr.recv(0, "a1")
        tr.wait_sends()
        return f"a1={x1[1].item()}"
    except P2POrderError as e:
        return f"P2POrderError: {e}"


def test_one_group_for_both_directions_is_caught_as_a_deadlock() -> None:
    stage0, stage1 = run_distributed(_one_group_traffic, 2, False, timeout=90)
    for text in (stage0, stage1):
        assert text.startswith("P2POrderError: under NCCL's point-to-point rules"), text
    # Each names what its queue is stuck on: stage 0 behind its send of a1, stage 1 behind its send of g0.
    assert "stuck at its send to rank 1 (256 bytes)" in stage0, stage0
    assert "stuck at its send to rank 0 (256 bytes)" in stage1, stage1


def test_one_group_per_link_and_direction_runs_the_same_traffic() -> None:
    assert run_distributed(_one_group_traffic, 2, True, timeout=90) == ["g0=0.0", "a1=1.0"]


def _crossed_order(rank: int, world_size: int) -> str:
    world = dist.group.WORLD
    assert world is not None
    p2p = OrderedP2P(world, "downstream", stall_s=10)
    if rank == 0:
        p2p.isend(torch.zeros(4, dtype=torch.uint8), 1).wait()
        p2p.isend(torch.zeros(8, dtype=torch.uint8), 1).wait()
        return "sent"
    try:
        p2p.irecv(torch.empty(8, dtype=torch.uint8), 0).wait()
    except P2POrderError as e:
        p2p.irecv(torch.empty(8, dtype=torch.uint8), 0).wait()  # the peer's second send still finds its receive
        return str(e)
    return "no error"


def test_a_receive_meeting_another_send_is_an_error() -> None:
    _, text = run_distributed(_crossed_order, 2, timeout=60)
    assert "would meet rank 0's send of 4 bytes" in text and "different orders" in text, text


def _groups_used(rank: int, world_size: int, dp: int) -> dict[str, Any]:
    """A loss-inside step and an evaluation at K = world_size / dp, every group a data transfer ran on recorded."""
    _ordered()
    used: list[dist.ProcessGroup] = []
    real_init = OrderedP2P.__init__

    def recording(self: OrderedP2P, group: dist.ProcessGroup, *args: Any, **kwargs: Any) -> None:
        used.append(group)
        real_init(self, group, *args, **kwargs)

    OrderedP2P.__init__ = recording  # type: ignore[method-assign]
    K, pipe = world_size // dp, None
    for d in range(dp):  # new_group is collective over the world: every rank makes every group
        group = dist.new_group(list(range(d * K, (d + 1) * K)), backend="gloo")
        if rank // K == d:
            pipe = group
    stage = GPipeStage(backbone(), chunks=3, group=None if dp == 1 else pipe, timeout=37)
    x, _ = batch(seed=0)
    stage.forward_backward(x, lambda out, m: out.square().sum(), schedule="gpipe")
    stage.output_mode = "all"
    with torch.no_grad():
        stage(x)
    OrderedP2P.__init__ = real_init  # type: ignore[method-assign]
    return {
        "sizes": sorted(dist.get_world_size(g) for g in used),
        "world": any(g is dist.group.WORLD for g in used),
        "pipeline": any(g is pipe for g in used),
        "timeouts": {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in used},
    }


@pytest.mark.parametrize(("world_size", "dp"), [(3, 1), (4, 2)])
def test_tensors_travel_on_a_group_per_link_never_on_the_world_or_pipeline_group(world_size: int, dp: int) -> None:
    """At dp = 1 the pipeline's group is the world's, whose queue every collective shares and which a failure does
    not abort: each link and direction has a two-rank group of its own, with a timeout past the stage's (the host's
    waits raise first, and the failure path aborts the group before NCCL's watchdog would end the process)."""
    for rank, r in enumerate(run_distributed(_groups_used, world_size, dp, timeout=90)):
        assert r["sizes"] and set(r["sizes"]) == {2}, (rank, r)
        assert not r["world"] and not r["pipeline"], (rank, r)
        assert r["timeouts"] == {data_timeout(timedelta(seconds=37)).total_seconds()} == {67.0}, (rank, r)
        # K = 3, the queues used: rank 0 to and from rank 1 and the output from rank 2; rank 1 to and from each
        # neighbour (the output from rank 2 shares that link); rank 2 to and from rank 1 and the output to rank 0.
        if world_size // dp == 3:
            assert len(r["sizes"]) == [3, 4, 3][rank], (rank, r)


# ------------------------------------------------------------------------------------------------- the matrix
def backbone() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(6)))


def batch(seed: int, n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def plain_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = backbone()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _check(stage: GPipeStage, expected: dict[str, torch.Tensor], what: str) -> int:
    checked = 0
    for name, p in stage.named_parameters():
        assert p.grad is not None, (what, name)
        err = (p.grad - expected[name]).abs().max() / expected[name].abs().max()
        assert err <= TOL, (what, name, float(err))
        checked += 1
    return checked


def _paths(stage: GPipeStage, x: torch.Tensor, y: torch.Tensor, checkpoint: str) -> list[str]:
    """Every path of the engine once on ``stage``: (path, gradients checked) for each."""
    expected = plain_grads(x, y)
    sizes = stage.micro_batch_sizes(x)
    offsets = [sum(sizes[:m]) for m in range(len(sizes))]
    done = []
    for output in ("last", "all", "placeholder"):  # fill/drain: an unchanged training step
        stage.output_mode = output
        stage.zero_grad()
        out = stage(x)
        if stage.is_last:
            nn.functional.mse_loss(out, y).backward()
        stage.backward()
        done.append(f"{checkpoint}/fill-drain/{output}:{_check(stage, expected, output)}")
    for schedule in SCHEDULES:  # the loss inside, per micro-batch on the last stage
        stage.zero_grad()

        def loss_fn(out: torch.Tensor, m: int) -> torch.Tensor:
            target = y[offsets[m] : offsets[m] + sizes[m]]
            return nn.functional.mse_loss(out, target, reduction="sum") / (y.numel())

        stage.forward_backward(x, loss_fn, schedule=schedule)
        done.append(f"{checkpoint}/{schedule}:{_check(stage, expected, schedule)}")
    for output in ("last", "all"):  # forward-only: validation and predict
        stage.output_mode = output
        with torch.no_grad():
            out = stage(x)
        if stage.is_last or output == "all":
            assert torch.allclose(out, backbone()(x), atol=1e-6)
        done.append(f"{checkpoint}/eval/{output}")
    return done


def _matrix(rank: int, world_size: int, K: int) -> list[str]:
    _ordered()
    dp = world_size // K
    pipe = None
    for d in range(dp):  # new_group is collective over the world: every rank makes every group
        ranks = list(range(d * K, (d + 1) * K))
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            pipe = group
    replica = rank // K
    x, y = batch(seed=replica, n=11 if K < 4 else 5)  # different data per replica; M = 3 uneven, or M < K = 4
    done = []
    for checkpoint in ("except_last", "always"):
        traced = checkpoint == "always"  # a traced step runs the untraced step's schedule (no wait for the device)
        stage = GPipeStage(
            copy.deepcopy(backbone()),
            chunks=3,
            checkpoint=checkpoint,
            group=pipe if dp > 1 else None,
            timeout=30,
            timeline=traced,
        )
        done += _paths(stage, x, y, checkpoint)
        recorded = {e.kind for e in stage.timeline.events}
        assert not traced or {"forward", "backward", "send", "recv-wait"} <= recorded, recorded
    return done


@pytest.mark.parametrize(("K", "world_size"), [(2, 2), (3, 3), (4, 4), (2, 4)])
def test_every_path_runs_under_nccl_rules(K: int, world_size: int) -> None:
    results = run_distributed(_matrix, world_size, K, timeout=240)
    paths = [[p.split(":")[0] for p in r] for r in results]
    assert all(p == paths[0] for p in paths), results
    assert len(set(paths[0])) == len(paths[0]) == 2 * (3 + len(SCHEDULES) + 2)
    # Every rank compared each of its stage's parameters with the plain model's, on every training path.
    assert all(int(p.split(":")[1]) > 0 for r in results for p in r if ":" in p), results


def _old_layout(rank: int, world_size: int) -> str:
    """The transport as it once was: activations and gradients on one group."""
    import lightning_gpipe.pipe.stage as stage_module

    _ordered()
    stage_module.link_groups = lambda *args: {}  # type: ignore[assignment]
    x, _ = batch(seed=0)
    stage = GPipeStage(backbone(), chunks=3, group=dist.group.WORLD, timeout=4)

    def loss_fn(out: torch.Tensor, m: int) -> torch.Tensor:
        return out.square().sum()

    try:
        stage.forward_backward(x, loss_fn, schedule="gpipe")
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_the_matrix_catches_the_old_single_group_layout() -> None:
    """The loss-inside step on one group for both directions: the cycle the issue found, stopped on every rank."""
    for text in run_distributed(_old_layout, 2, timeout=90):
        assert text.startswith("PipelineError") and "under NCCL's point-to-point rules" in text, text


def _fails_in_the_loss(rank: int, world_size: int, schedule: str) -> dict:
    """Stage 1's loss fails on micro-batch 1, while stage 0 has transfers posted ahead (its gradient receives)."""
    _ordered()
    x, _ = batch(seed=0)
    stage = GPipeStage(backbone(), chunks=3, timeout=20)

    def loss_fn(out: torch.Tensor, m: int) -> torch.Tensor:
        if m == 1:
            raise ValueError("the loss failed")
        return out.square().sum()

    error = ""
    try:
        stage.forward_backward(x, loss_fn, schedule=schedule)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    transport = stage._failures._links.transport  # type: ignore[union-attr]
    queues = {id(q): q for q in transport._ordered.values()}.values()
    try:
        transport.send(1 - rank, torch.ones(4))
        later = "posted"
    except P2POrderError as e:
        later = str(e)
    return {"error": error, "posted": sum(q.posted for q in queues), "later": later}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failure_aborts_the_transfers_posted_ahead(schedule: str) -> None:
    """Every rank raises the loss's error, and nothing stays posted on its data groups (NCCL would keep a receive
    posted ahead of the failure, and the kernels behind it, until its watchdog fires); later transfers fail."""
    for rank, r in enumerate(run_distributed(_fails_in_the_loss, 2, schedule, timeout=90)):
        assert r["error"].startswith("PipelineError") and "the loss failed" in r["error"], (rank, r)
        assert r["posted"] == 0, (rank, r)
        assert "was aborted" in r["later"], (rank, r)
