"""NCCL's point-to-point ordering on any backend: a test mode in which gloo stops where NCCL would hang.

NCCL runs the point-to-point operations of one communicator one after another, in the order each rank posted them,
and a send larger than its buffers completes only when the peer's matching receive runs; it has no tags, so the
n-th send from rank a to rank b meets b's n-th receive from a whatever either meant. gloo buffers sends and matches
them by tag, so traffic that forms a cycle under NCCL's rules runs on gloo and hangs on GPUs.

With ``GPIPE_NCCL_SEMANTICS=1`` in the environment the transport sends its tensors through :class:`OrderedP2P`:
per rank, one thread per process group runs that group's operations in posting order, and every send waits until
the receiver has taken it (as a large NCCL send does). Wherever NCCL would hang, the wait that never ends raises
:class:`P2POrderError` naming the operation this rank's queue is stuck on and what is queued behind it; a receive
that meets a send of another size raises too (NCCL would silently hand it the wrong bytes). Waits block the host:
under NCCL they block the CUDA stream, and since every later operation is ordered after that stream, no order that
hangs here runs there and no order that runs here hangs there.
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

ENV = "GPIPE_NCCL_SEMANTICS"
# One tag for all of this mode's traffic: NCCL has no tags, so neither does the model of it.
_TAG = 7_919


def enabled() -> bool:
    """Whether this process runs its pipeline transport under NCCL's ordering rules (``GPIPE_NCCL_SEMANTICS=1``)."""
    return os.environ.get(ENV, "0") not in ("", "0")


class P2POrderError(RuntimeError):
    """Under NCCL's point-to-point rules this wait would never end, or a receive would get another send's bytes."""


class _Op:
    """One posted send or receive; completes when this rank's queue has run it (a work handle's interface)."""

    def __init__(self, queue_: OrderedP2P, kind: Literal["send", "recv"], buf: torch.Tensor, peer: int) -> None:
        self.queue, self.kind, self.buf, self.peer = queue_, kind, buf, peer
        self.done = threading.Event()
        self.error: BaseException | None = None

    def __str__(self) -> str:
        verb = f"send to rank {self.peer}" if self.kind == "send" else f"receive from rank {self.peer}"
        return f"{verb} ({self.buf.numel()} bytes)"

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        stall = self.queue.stall_s if timeout is None else min(self.queue.stall_s, timeout.total_seconds())
        if not self.done.wait(stall):
            raise P2POrderError(self.queue.stuck(self, stall))
        if self.error is not None:
            raise self.error
        return True


class OrderedP2P:
    """This rank's point-to-point operations on ``group``, run in posting order by one thread (see the module).

    ``name`` names the group in errors; a wait that has not ended after ``stall_s`` seconds is taken for a hang.
    """

    def __init__(self, group: dist.ProcessGroup, name: str, stall_s: float) -> None:
        self.group, self.name, self.stall_s = group, name, stall_s
        self.rank = dist.get_rank(group)
        self._queue: queue.Queue[_Op] = queue.Queue()
        self._posted: list[_Op] = []  # not yet run, in order; [0] is running
        self._lock = threading.Lock()
        self._aborted = False
        threading.Thread(target=self._run, name=f"nccl-order-{name}", daemon=True).start()

    @property
    def posted(self) -> int:
        """How many of this rank's operations on the group have not run yet."""
        with self._lock:
            return len(self._posted)

    def abort(self) -> None:
        """Fail every operation posted and every later one, as an aborted NCCL communicator does."""
        with self._lock:
            self._aborted, posted, self._posted = True, self._posted, []
        for op in posted:
            op.error = P2POrderError(f"the {self.name} group was aborted before its {op} ran")
            op.done.set()

    def isend(self, buf: torch.Tensor, dst: int) -> _Op:
        return self._post(_Op(self, "send", buf, dst))

    def irecv(self, buf: torch.Tensor, src: int) -> _Op:
        return self._post(_Op(self, "recv", buf, src))

    def _post(self, op: _Op) -> _Op:
        with self._lock:
            if self._aborted:
                raise P2POrderError(f"the {self.name} group was aborted: {op} cannot run")
            self._posted.append(op)
        self._queue.put(op)
        return op

    def stuck(self, waited: _Op, stall_s: float) -> str:
        with self._lock:
            posted = list(self._posted)
        head = posted[0] if posted else None
        ahead = posted.index(waited) if waited in posted else 0
        partner = "receive" if head is not None and head.kind == "send" else "send"
        text = (
            f"under NCCL's point-to-point rules rank {self.rank} of the {self.name} group would wait forever for "
            f"its {waited} (nothing moved for {stall_s:.0f} s; ranks are the group's: on the pipeline's groups, its "
            f"stages; on a long skip's, its two ends): the group's queue on rank {self.rank} runs one operation at a "
            f"time, in posting order, and is stuck at its {head}, which completes only when rank "
            f"{head.peer if head else '?'} runs the matching {partner}"
        )
        if ahead:
            text += f"; {ahead} operation(s) are ahead of the one waited for"
        behind = posted[ahead + 1 : ahead + 4]
        if behind:
            text += "; queued behind it: " + ", ".join(str(op) for op in behind)
        return text + ". A dependency cycle: send each direction on its own group, or post in an order both agree on"

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op.done.is_set():  # failed by abort() before it ran
                continue
            try:
                self._rendezvous(op)
            except BaseException as e:  # handed to the waiter: this thread must outlive any one failure
                op.error = e
            with self._lock:
                if op in self._posted:
                    self._posted.remove(op)
            op.done.set()

    def _rendezvous(self, op: _Op) -> None:
        group, peer = self.group, op.peer
        size = torch.tensor([op.buf.numel()], dtype=torch.int64)
        ack = torch.zeros(1, dtype=torch.int64)
        if op.kind == "send":
            dist.send(size, group=group, group_dst=peer, tag=_TAG)
            if op.buf.numel():
                dist.send(op.buf, group=group, group_dst=peer, tag=_TAG)
            dist.recv(ack, group=group, group_src=peer, tag=_TAG)  # the receive ran: only now does the send end
            return
        sent = torch.empty(1, dtype=torch.int64)
        dist.recv(sent, group=group, group_src=peer, tag=_TAG)
        n = int(sent)
        into = op.buf if n == op.buf.numel() else torch.empty(n, dtype=torch.uint8)
        if n:
            dist.recv(into, group=group, group_src=peer, tag=_TAG)
        dist.send(ack, group=group, group_dst=peer, tag=_TAG)
        if into is not op.buf:
            raise P2POrderError(
                f"under NCCL's point-to-point rules the {op} of rank {self.rank} of the {self.name} group would "
                f"meet rank {peer}'s send of {n} bytes: NCCL pairs a rank's n-th send with the peer's n-th receive, "
                "so the two ranks posted their transfers in different orders"
            )
