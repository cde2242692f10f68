"""Point-to-point transport of nested tensor structures between stages, each message with a self-describing header.

A message is one fixed-size header (plus an overflow part for very large structures) followed by the raw bytes of
each tensor. The header says the structure, every tensor's dtype, shape and whether it needs a gradient, so shapes
and dtypes may change with every message. Headers travel on a CPU (gloo) group, tensors on the data group (gloo on
CPU, NCCL on GPU). Sends never block: they are queued and retired once the peer has received them. A header may
instead carry an error, which is how a failing stage wakes up peers that wait for it.
"""

from __future__ import annotations

import pickle
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from lightning_gpipe.pipe.microbatch import differentiable

HEADER_BYTES = 1024
# How long a stage waits for a peer before raising PipelineTimeout, unless told otherwise (torch.distributed's default).
DEFAULT_TIMEOUT_S = 1800.0
_LEN = struct.Struct("<q")
# Each directed pair of stages carries one kind of traffic; tags only keep headers apart from tensor bytes.
HEADER_TAG, DATA_TAG, OUTPUT_TAG, OUTPUT_DATA_TAG = 0, 1, 2, 3


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


class _Slot:
    """Stands in a pickled structure for the i-th tensor of the message."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple:
        return (_Slot, (self.i,))


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class PendingRecv:
    """A receive already posted; ``wait`` returns the structure or raises the error a peer sent instead."""

    def __init__(self, transport: Transport, src: int, tag: int, expect: list[TensorMeta] | None, what: str) -> None:
        self.transport, self.src, self.tag, self.expect, self.what = transport, src, tag, expect, what
        self.header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self.header_work = transport._irecv(self.header, src, tag, header=True)
        self.tensors: list[torch.Tensor] = []
        self.works: list[Any] = []
        if expect is not None:
            # The shapes are known (gradients of what this stage sent), so the bytes can flow before we ask for them.
            self._post_tensors(expect)

    def _post_tensors(self, metas: list[TensorMeta]) -> None:
        for meta in metas:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=self.transport.device)
            self.tensors.append(t)
            if t.numel():
                self.works.append(self.transport._irecv(_wire(t), self.src, self.tag + 1, header=False))

    def wait(self) -> tuple[Any, dict]:
        tr = self.transport
        tr._wait(self.header_work, f"the header of {self.what}", self.src)
        n = _LEN.unpack(self.header[: _LEN.size].numpy().tobytes())[0]
        payload = self.header[_LEN.size : _LEN.size + n].numpy().tobytes()
        if n > HEADER_BYTES - _LEN.size:
            rest = torch.empty(n - (HEADER_BYTES - _LEN.size), dtype=torch.uint8)
            tr._wait(tr._irecv(rest, self.src, self.tag, header=True), f"the header of {self.what}", self.src)
            payload += rest.numpy().tobytes()
        header = pickle.loads(payload)
        if "error" in header:
            err = PipelineError.from_wire(header["error"], received_by=tr.stage)
            err.via = self.src
            raise err
        metas: list[TensorMeta] = header["metas"]
        if self.expect is None:
            self._post_tensors(metas)
        elif [(m.dtype, m.shape) for m in metas] != [(m.dtype, m.shape) for m in self.expect]:
            raise RuntimeError(
                f"stage {self.src} sent {metas} for {self.what}, but stage {tr.stage} expected {self.expect}"
            )
        for work in self.works:
            tr._wait(work, self.what, self.src)
        for t, meta in zip(self.tensors, metas):
            if meta.requires_grad and differentiable(t):
                t.requires_grad_()
        tensors = self.tensors
        obj = tree_map(lambda x: tensors[x.i] if isinstance(x, _Slot) else x, header["skeleton"])
        return obj, header["fields"]


class Transport:
    """Sends and receives nested tensor structures between the stages (group ranks) of one pipeline group."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        device: torch.device,
        timeout: timedelta,
        header_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.header_group = header_group if header_group is not None else group
        self.stage = dist.get_rank(group)
        self.device = device
        self.timeout = timeout
        self._pending_sends: list[tuple[Any, torch.Tensor, int]] = []

    def _irecv(self, buf: torch.Tensor, src: int, tag: int, header: bool) -> Any:
        group = self.header_group if header else self.group
        return dist.irecv(buf, group=group, group_src=src, tag=tag)

    def _isend(self, buf: torch.Tensor, dst: int, tag: int, header: bool) -> None:
        group = self.header_group if header else self.group
        try:
            work = dist.isend(buf, group=group, group_dst=dst, tag=tag)
        except RuntimeError as e:
            raise self._lost(e, f"stage {dst} to take a message", dst) from e
        # The handle must stay referenced until the peer received it: dropping a gloo send's handle cancels it.
        self._pending_sends.append((work, buf, dst))

    def _lost(self, e: RuntimeError, waited_for: str, peer: int) -> RuntimeError:
        text = str(e)
        if "imed out" in text:
            return PipelineTimeout(
                f"stage {self.stage} waited {self.timeout.total_seconds():.0f} s for {waited_for} and gave up. "
                f"Stage {peer} probably died, hung, or did not make the same pipeline call: a pipelined module must "
                "be called (and its backward run) on every stage of the pipeline, never on one rank only",
                stage=peer,
                phase="transport",
            )
        if "onnection" in text:  # "Connection closed by peer", "Connection reset by peer"
            return PipelineTimeout(
                f"stage {self.stage} lost its connection to stage {peer} while waiting for {waited_for}: the "
                f"process of stage {peer} probably died (look for its error above, or for an out-of-memory kill), "
                "or ended without making the same pipeline call: a pipelined module must be called on every stage "
                "of the pipeline, never on one rank only",
                stage=peer,
                phase="transport",
            )
        return e

    def _wait(self, work: Any, what: str, peer: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e, f"{what} from stage {peer}", peer) from e

    def _send_header(self, dst: int, header: dict, tag: int) -> None:
        payload = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        first = HEADER_BYTES - _LEN.size
        buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        buf[: _LEN.size] = torch.frombuffer(bytearray(_LEN.pack(len(payload))), dtype=torch.uint8)
        head = payload[:first]
        if head:
            buf[_LEN.size : _LEN.size + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._isend(buf, dst, tag, header=True)
        if len(payload) > first:
            self._isend(torch.frombuffer(bytearray(payload[first:]), dtype=torch.uint8), dst, tag, header=True)

    def send(
        self, dst: int, obj: Any, *, requires_grad: list[bool] | None = None, tag: int = HEADER_TAG, **fields: Any
    ) -> list[TensorMeta]:
        """Queue ``obj`` for stage ``dst``; ``requires_grad[i]``: the peer differentiates the i-th tensor."""
        leaves, _ = tree_flatten(obj)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        counter = iter(range(len(tensors)))
        skeleton = tree_map(lambda x: _Slot(next(counter)) if isinstance(x, torch.Tensor) else x, obj)
        if requires_grad is None:
            requires_grad = [t.requires_grad for t in tensors]
        metas = [TensorMeta(t.dtype, tuple(t.shape), rg) for t, rg in zip(tensors, requires_grad)]
        self._send_header(dst, {"skeleton": skeleton, "metas": metas, "fields": fields}, tag)
        for t in tensors:
            if t.numel():
                self._isend(_wire(t), dst, tag + 1, header=False)
        return metas

    def post_recv(
        self, src: int, what: str, *, tag: int = HEADER_TAG, expect: list[TensorMeta] | None = None
    ) -> PendingRecv:
        return PendingRecv(self, src, tag, expect, what)

    def recv(self, src: int, what: str, *, tag: int = HEADER_TAG) -> tuple[Any, dict]:
        return self.post_recv(src, what, tag=tag).wait()

    def send_error(self, dst: int, error: PipelineError, tag: int = HEADER_TAG) -> None:
        self._send_header(dst, {"error": error.to_wire()}, tag)

    def retire_sends(self) -> None:
        """Drop the sends the peers have received, releasing their buffers; never blocks."""
        self._pending_sends = [(w, b, d) for w, b, d in self._pending_sends if not w.is_completed()]

    def unreceived(self) -> list[int]:
        """The stages that have not yet received something this stage sent them."""
        return sorted({d for w, _, d in self._pending_sends if not w.is_completed()})

    def wait_sends(self) -> None:
        for work, _, dst in self._pending_sends:
            try:
                work.wait(self.timeout)
            except RuntimeError as e:
                raise self._lost(e, f"stage {dst} to receive a message", dst) from e
        self._pending_sends.clear()

    def abandon_sends(self, grace_s: float = 2.0) -> None:
        """Forget sends no peer will receive (after a failure); the process group should not be reused.

        A peer may be receiving one right now (stage 0 reading the output the last stage sent just before it failed):
        polled, not waited on, for up to ``grace_s`` so that the peer gets it and fails on its own instead of hanging.
        """
        deadline = time.monotonic() + grace_s
        while any(not w.is_completed() for w, _, _ in self._pending_sends) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._pending_sends.clear()


def cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Headers and status checks are read on the CPU: with NCCL they need a gloo group over the same ranks."""
    if dist.get_backend(group) == "gloo":
        return group
    if group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"the pipeline group uses {dist.get_backend(group)!r}; pass header_group=, a gloo group over the same "
            "ranks (dist.new_group(ranks, backend='gloo'), created on every rank of the world)"
        )
    headers = dist.new_group(backend="gloo")
    assert isinstance(headers, dist.ProcessGroup), "every rank is a member of a group over all ranks"
    return headers
