"""Transport between two ranks: self-describing messages whose structure, shapes and dtypes change every time."""

from __future__ import annotations

import os
import pickle
import time
from collections import namedtuple
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from lightning_gpipe.pipe.comm.framing import HEADER_BYTES, INLINE_MAX, Sizes, TensorMeta, layout
from lightning_gpipe.pipe.comm.transport import OUTPUT_TAG, Transport
from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from tests.helpers.launch import run_distributed

# Module level: the receiver unpickles it from the header's skeleton.
Point = namedtuple("Point", ["xy", "label"])

SENDER, RECEIVER = 0, 1


def make_transport(timeout_s: float = 30.0) -> Transport:
    return Transport(dist.group.WORLD, device=torch.device("cpu"), timeout=timedelta(seconds=timeout_s))


def messages() -> list[tuple[Any, list[bool] | None, dict]]:
    """(structure, requires_grad argument, header fields) for each message; both ranks build the same list."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def randint(*shape: int, dtype: torch.dtype, high: int = 100) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=g).to(dtype)

    grad_leaf = randn(3, 4).requires_grad_()  # sent with the default requires_grad (taken from the tensor)
    return [
        (randn(4, 3), None, {}),
        (randn(2, 5, dtype=torch.float64), [True], {"m": 0, "M": 4}),
        (grad_leaf, None, {"m": 1}),
        ((randn(6, dtype=torch.bfloat16), randn(1, 2, 3, dtype=torch.float16)), [True, False], {"name": "halves"}),
        ([randint(5, dtype=torch.int64), randint(2, 2, dtype=torch.int32)], None, {}),
        ({"bytes": randint(7, dtype=torch.uint8, high=256), "mask": randint(3, dtype=torch.bool, high=2)}, None, {}),
        (torch.tensor(3.5), [True], {}),  # 0-dim
        ((torch.empty(0, 3), torch.empty(2, 0, dtype=torch.int64), randn(2)), [True, False, False], {}),
        (randn(4, 6).t(), [False], {}),  # non-contiguous
        (
            {
                "h": randn(3, 2),
                "ids": randint(3, 4, dtype=torch.int64),
                "points": [Point(randn(3, 2, dtype=torch.float64), "a"), Point(randint(3, dtype=torch.int32), "b")],
                "meta": ("nmt", 7, None, 2.5),
                "nothing": None,
            },
            [True, False, True, False],
            {"m": 3, "M": 4, "extra": ("x", 1)},
        ),
        # Far larger than one header: takes the overflow path.
        ({f"key_{i:03d}": (i, f"value {i}") for i in range(500)} | {"t": randn(2, 2)}, None, {"big": True}),
        ("just a string", None, {}),
    ]


def expected_requires_grad(obj: Any, requires_grad: list[bool] | None) -> list[bool]:
    tensors = [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]
    return [t.requires_grad for t in tensors] if requires_grad is None else requires_grad


def assert_same(got: Any, sent: Any) -> None:
    got_leaves, got_spec = tree_flatten(got)
    sent_leaves, sent_spec = tree_flatten(sent)
    assert got_spec == sent_spec, f"structure changed: {got_spec} != {sent_spec}"
    for a, b in zip(got_leaves, sent_leaves):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (a, b)
            assert torch.equal(a, b.detach()), (a, b)
        else:
            assert type(a) is type(b) and a == b, (a, b)


def roundtrip_worker(rank: int, world_size: int) -> int:
    tr = make_transport()
    msgs = messages()
    if rank == SENDER:
        for obj, requires_grad, fields in msgs:
            tr.send(RECEIVER, obj, requires_grad=requires_grad, **fields)
        # The pipeline's output broadcast travels on its own tag, interleaved with stage-to-stage traffic.
        tr.send(RECEIVER, {"out": torch.ones(2)}, tag=OUTPUT_TAG)
        tr.wait_sends()
        return len(msgs)
    # Receive the OUTPUT_TAG message first although it was sent last: tags keep the two streams apart.
    out, _ = tr.recv(SENDER, "output", tag=OUTPUT_TAG)
    assert torch.equal(out["out"], torch.ones(2))
    for i, (sent, requires_grad, fields) in enumerate(msgs):
        got, got_fields = tr.recv(SENDER, f"message {i}")
        assert_same(got, sent)
        assert got_fields == fields
        tensors = [x for x in tree_flatten(got)[0] if isinstance(x, torch.Tensor)]
        assert [t.requires_grad for t in tensors] == expected_requires_grad(sent, requires_grad), i
        for t in tensors:
            assert t.is_leaf  # a received tensor starts a fresh graph on this stage
            if not (t.is_floating_point() or t.is_complex()):
                assert not t.requires_grad
    return len(msgs)


@pytest.mark.timeout(60)
def test_roundtrip_changing_structures() -> None:
    msgs = messages()
    assert len(pickle.dumps(msgs[-2][0])) > 2 * HEADER_BYTES  # the large one really needs the overflow part
    n = len(msgs)
    assert run_distributed(roundtrip_worker, 2, timeout=45) == [n, n]


GRADS = [torch.arange(12.0).reshape(4, 3), torch.empty(0, 2, dtype=torch.float64), torch.tensor(2.0)]


def grad_metas() -> list[TensorMeta]:
    return [TensorMeta(t.dtype, tuple(t.shape), False) for t in GRADS]


def pre_posted_worker(rank: int, world_size: int) -> str:
    tr = make_transport()
    if rank == SENDER:
        dist.barrier()  # the receiver has posted before anything is sent
        tr.send(RECEIVER, GRADS, m=5)
        # Same number of bytes, different dtype: only the header can tell.
        tr.send(RECEIVER, [torch.zeros(4, 3, dtype=torch.int32)])
        tr.wait_sends()
        return "sent"
    pending = tr.post_recv(SENDER, "gradients", expect=grad_metas())
    dist.barrier()
    got, fields = pending.wait()
    assert fields == {"m": 5}
    assert_same(got, GRADS)
    expect = [TensorMeta(torch.float32, (4, 3), False)]
    with pytest.raises(RuntimeError, match=r"stage 0 sent .* but stage 1 expected"):
        tr.post_recv(SENDER, "mismatched gradients", expect=expect).wait()
    return "received"


@pytest.mark.timeout(60)
def test_pre_posted_receive_with_expected_shapes() -> None:
    assert run_distributed(pre_posted_worker, 2, timeout=45) == ["sent", "received"]


def error_worker(rank: int, world_size: int) -> tuple[str, int, int | None]:
    tr = make_transport()
    if rank == SENDER:
        err = PipelineError.from_exception(ValueError("boom"), stage=0, phase="forward", micro_batch=2)
        tr.send_error(RECEIVER, err)
        tr.wait_sends()
        return ("sent", 0, None)
    try:
        tr.recv(SENDER, "micro-batch 2's input")
    except PipelineError as e:
        return (str(e), e.stage, e.via)
    return ("no error", -1, None)


@pytest.mark.timeout(60)
def test_error_header_raises_pipeline_error() -> None:
    _, (message, stage, via) = run_distributed(error_worker, 2, timeout=45)
    assert stage == 0 and via == 0
    assert "stage 0 failed in the forward phase (micro-batch 2): ValueError: boom" in message
    assert "traceback of stage 0" in message  # the remote traceback is attached for the receiving rank


def timeout_worker(rank: int, world_size: int) -> tuple[str, float]:
    tr = make_transport(timeout_s=2.0)
    if rank == SENDER:
        # Stay alive (and send nothing) until the receiver gave up: a dead peer fails differently (connection
        # closed). No barrier afterwards: gloo closes the pair whose wait timed out, so the group is unusable.
        time.sleep(tr.timeout.total_seconds() + 3)
        return ("silent", 0.0)
    start = time.monotonic()
    try:
        tr.recv(SENDER, "micro-batch 0's input")
        outcome = "received"
    except PipelineTimeout as e:
        outcome = str(e)
    return (outcome, time.monotonic() - start)


@pytest.mark.timeout(60)
def test_recv_without_sender_times_out() -> None:
    _, (message, elapsed) = run_distributed(timeout_worker, 2, timeout=45)
    assert "stage 1 waited 2 s for the header of micro-batch 0's input from stage 0" in message
    assert "probably died, hung, or did not make the same pipeline call" in message
    assert 1.5 <= elapsed < 10


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (
            "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete",
            "waited",
        ),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV, NumelIn=4096, "
            "NumelOut=4096, Timeout(ms)=1800000) ran for 1800023 milliseconds before timing out.",
            "waited",
        ),
        ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:2345", "lost"),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:2051, remote process exited or there was a network error, NCCL "
            "version 2.27.5\\nncclRemoteError: A call failed possibly due to a network error or a remote process "
            "exiting prematurely.",
            "lost",
        ),
        ("NCCL communicator was aborted on rank 0.", "lost"),
        ("CUDA error: an illegal memory access was encountered", None),
    ],
)
def test_gloo_and_nccl_failures_of_a_peer_are_named(text: str, kind: str | None) -> None:
    """Both backends' words for a wait that ran out and for a peer that is gone become PipelineTimeout, naming the
    peer; anything else (this rank's own CUDA error) is left as it is."""
    tr = Transport.__new__(Transport)
    tr.stage, tr.timeout = 0, timedelta(seconds=60)
    got = tr._lost(RuntimeError(text), "micro-batch 3's output gradient from stage 1", 1)
    if kind is None:
        assert not isinstance(got, PipelineError)
        return
    assert isinstance(got, PipelineTimeout) and got.stage == 1, got
    assert ("waited 60 s for micro-batch 3's" if kind == "waited" else "lost its connection to stage 1") in str(got)


def test_a_stage_that_gets_another_micro_batch_than_it_waits_for_says_so() -> None:
    """gloo hands over messages in the order they were sent, whatever the receiver meant: the header's m is checked."""
    from lightning_gpipe.pipe.comm.links import Links
    from lightning_gpipe.pipe.trace.events import Timeline

    class Sent:
        def __init__(self, m: int) -> None:
            self.m = m

        def recv(self, src: int, what: str) -> tuple[torch.Tensor, dict[str, Any]]:
            return torch.zeros(1), {"m": self.m, "M": 4, "n": 1, "training": True, "seed": 0}

    links = Links(Sent(1), None, index=1, timeline=Timeline(1))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="waited for micro-batch 0's input and got micro-batch 1's from stage 0"):
        links.receive(0, training=True)
    assert links.receive(1, training=True)[1]["m"] == 1


class _FailedWork:
    """A send whose stream hit an asynchronous CUDA error: NCCL's ``is_completed`` raises it."""

    def is_completed(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_send_that_raises_on_its_completion_check_does_not_stop_the_failure_path() -> None:
    """After a failure the handler asks which peers have not received yet and drops the sends; a work that raises
    there (an asynchronous CUDA error) must count as ended, or the error notices to the other stages are skipped."""
    transport = Transport.__new__(Transport)  # the bookkeeping alone: no process group needed
    buf = torch.zeros(1)
    transport._pending_sends = [(_FailedWork(), buf, 1, True), (_FailedWork(), buf, 2, False)]
    assert transport.unreceived() == []
    transport.abandon_sends(grace_s=0.5)
    assert transport._pending_sends == []
    transport._pending_sends = [(_FailedWork(), buf, 1, True)]
    transport.retire_sends()
    assert transport._pending_sends == []


def ahead_worker(rank: int, world_size: int) -> list[str]:
    """Receives posted ahead: a poll posts the tensors once the header came, never reads an overflowing header
    (its second part is the next message on the tag), and an error header raises where the receive is taken."""
    tr = make_transport()
    tr.posts_ahead = True  # as on NCCL; gloo's own transfers gain nothing from it
    tr.sizes_out, tr.sizes_in = Sizes(False), Sizes(False)  # and, as there, every header apart from its tensors
    big = {"names": [f"name {i}" * 4 for i in range(60)], "t": torch.arange(6.0)}  # a header past HEADER_BYTES
    if rank == SENDER:
        tr.send(RECEIVER, torch.arange(3.0), m=0)
        tr.send(RECEIVER, big, m=1)
        tr.send(RECEIVER, torch.ones(2), m=2)
        tr.send_error(RECEIVER, PipelineError("stage 0 broke", stage=0, phase="forward"))
        tr.wait_sends()
        dist.barrier()
        return []
    seen = []
    for m in range(4):
        tr.post_ahead(SENDER, f"message {m}")
        pending = tr._ahead[SENDER, 0][0]
        deadline = time.monotonic() + 20
        while not pending._arriving() and time.monotonic() < deadline:
            time.sleep(0.01)
        tr.poll()
        seen.append(f"{m}: {len(pending.works)} posted by the poll")
        if m == 3:
            with pytest.raises(PipelineError, match="stage 0 broke"):
                tr.recv(SENDER, "an error")
            continue
        got, fields = tr.recv(SENDER, f"message {m}")
        assert fields == {"m": m}, fields
        assert_same(got, big if m == 1 else torch.arange(3.0) if m == 0 else torch.ones(2))
    assert not tr._ahead[SENDER, 0]
    dist.barrier()
    return seen


@pytest.mark.timeout(60)
def test_receives_posted_ahead_post_their_tensors_at_a_poll() -> None:
    _, seen = run_distributed(ahead_worker, 2, timeout=45)
    assert seen == [
        "0: 1 posted by the poll",
        "1: 0 posted by the poll",  # the overflow part is read where the receive is taken
        "2: 1 posted by the poll",
        "3: 0 posted by the poll",  # an error notice: nothing to post
    ]


def inputs_ahead_worker(rank: int, world_size: int, path: str, nccl: bool = True) -> list[int]:
    """Per step of stage 1, how many of its inputs had their tensors posted by a poll, before it waited for them;
    under NCCL's rules (``GPIPE_NCCL_SEMANTICS``), where receives are posted ahead."""
    from torch import nn

    from lightning_gpipe.pipe.comm.nccl_order import ENV

    os.environ[ENV] = "1" if nccl else "0"

    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.pipe.comm import transport as transport_module

    polled: list[int] = []
    original = transport_module.PendingRecv.poll

    def poll(self: transport_module.PendingRecv) -> None:
        before = self._read
        original(self)
        if before is None and self._read is not None:
            polled.append(self.tag)

    transport_module.PendingRecv.poll = poll  # type: ignore[method-assign]

    class Slow(nn.Module):
        """Stage 1 computes slowly: the next input's header comes while it computes."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.1)
            return x

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), Slow(), nn.Linear(4, 4)]
    stage = GPipeStage(nn.Sequential(*layers), chunks=4, balance=[2, 2], timeout=30)
    x = torch.randn(8, 4)
    if path == "eval":
        with torch.no_grad():
            stage(x)
    elif path == "fill-drain":
        out = stage(x)
        if stage.is_last:
            out.sum().backward()
        stage.backward()
    else:
        stage.forward_backward(x, lambda out, m: out.sum(), schedule=path)
    return [len(polled)]


@pytest.mark.parametrize("path", ["eval", "fill-drain", "gpipe", "1f1b"])
@pytest.mark.timeout(60)
def test_stage_inputs_are_received_ahead(path: str) -> None:
    """M = 4: inputs 1, 2 and 3 are posted with the receive before them, and their tensors' receives at a poll
    around the compute before them, not where the stage waits for them (under 1f1b too: no gradient from stage 0
    comes between). On plain gloo none is."""
    assert run_distributed(inputs_ahead_worker, 2, path, timeout=45) == [[0], [3]]
    assert run_distributed(inputs_ahead_worker, 2, path, False, timeout=45) == [[0], [0]]


def framing_worker(rank: int, world_size: int) -> list[int] | bool:
    """Messages of the shapes just seen on a link travel as one (header and tensors), others as the header and then
    each tensor; an error notice after a large message still fits the size both ends agreed."""
    tr = make_transport()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 16, generator=g), torch.randn(32, 8, generator=g).double()
    big = torch.randn(INLINE_MAX // 4 + 1, generator=g)  # past INLINE_MAX: its tensor goes apart
    seq = [a, a, b, a, b, big, a, torch.randn(300, 16, generator=g), a]
    if rank == SENDER:
        counts = []
        for t in seq:
            before = len(tr._pending_sends)
            tr.send(RECEIVER, t)
            counts.append(len(tr._pending_sends) - before)
        tr.send_error(RECEIVER, PipelineError("stage 0 broke", stage=0, phase="forward"))
        tr.send(RECEIVER, a)
        tr.wait_sends()
        return counts
    for i, t in enumerate(seq):
        got, _ = tr.recv(SENDER, f"message {i}")
        assert torch.equal(got, t) and got.is_leaf, i
    with pytest.raises(PipelineError, match="stage 0 broke"):
        tr.recv(SENDER, "an error")
    first = tr.post_recv(SENDER, "the last one")
    with pytest.raises(RuntimeError, match="second receive from stage 0 on tag 0 before reading the first"):
        tr.post_recv(SENDER, "one more")
    assert torch.equal(first.wait()[0], a)
    return tr.bytes_received[SENDER] == sum(t.numel() * t.element_size() for t in [*seq, a])


@pytest.mark.timeout(60)
def test_messages_of_the_shapes_just_seen_travel_as_one() -> None:
    counts, received_all = run_distributed(framing_worker, 2, timeout=45)
    # a: apart (the first message's size is HEADER_BYTES), then one; b, smaller, fits a's size; big goes apart; a
    # fits the size the window still holds; a larger shape goes apart.
    assert counts == [2, 1, 1, 1, 1, 2, 1, 2, 1]
    assert received_all is True


def test_sizes_agree_and_stay_fixed_where_tensors_travel_apart() -> None:
    inline, apart = Sizes(True), Sizes(False)
    metas = [TensorMeta(torch.float32, (64, 16), False)]
    offsets, end = layout(200, metas)
    assert offsets[0] % 64 == 0 and end >= 200 + 64 * 16 * 4
    for sizes in (inline, apart):
        assert sizes.size((1, 0)) == HEADER_BYTES and not sizes.fits(HEADER_BYTES, metas, end)
        sizes.record((1, 0), end)
    assert inline.size((1, 0)) >= end and inline.fits(inline.size((1, 0)), metas, end)
    assert inline.size((1, 2)) == HEADER_BYTES  # another tag: its own history
    assert apart.size((1, 0)) == HEADER_BYTES and not apart.fits(10 * end, metas, end)
