"""Point-to-point transport of nested tensor structures between stages, each message with a self-describing header.

A message is a header (plus an overflow part for very large structures) and the raw bytes of each tensor. The header
says the structure, every tensor's dtype, shape and whether it needs a gradient, so shapes and dtypes may change
with every message. Headers travel on a CPU (gloo) group, tensors on data groups (gloo on CPU, NCCL on GPU); on gloo
between CPU processes a message of the shapes just seen on its link carries its tensors beside its header, in one
message (``framing``). NCCL runs one communicator's transfers in posting order and a large send ends only when its
receive runs, so activations and gradients queued on one communicator form a cycle (stage 0: send a0, send a1,
recv g0; the last stage: recv a0, send g0, recv a1) that hangs, and a middle stage's receive from k − 1 would wait
behind its own send to k + 1. Where order matters each link and direction has a group of its own over its two ranks
(``groups.link_groups``: k → k + 1, k + 1 → k, the ring's hop for interleaving, the last stage's output), and so does
each long skip (one per pair of stages and direction); no tensor travels on the pipeline's group, which at dp = 1 is
the world's, shared with every collective. Every queue then runs in one order that both of its ends agree on
(``nccl_order`` checks it on CPU). On gloo, which buffers sends and matches by tag, the pipeline's group carries them.

Sends never block: they are queued and retired once the peer has received them. On NCCL a wait for tensor data
makes the CUDA stream wait, not the host (the header, on gloo, already told the host what comes and from whom, and
carries timeouts and errors). A header may instead carry an error, which is how a failing stage wakes up peers
that wait for it. On NCCL a receive can be posted ahead of the call that takes it (``post_ahead``): its tensors'
receives go out at the first ``poll`` after its header came, before the stage queues its next compute, because a
receive posted after a compute waits for that compute on the stream.
"""

from __future__ import annotations

import pickle
import time
from collections import Counter, defaultdict, deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.pipe._torch_internals import abort_together, tree_flatten, tree_map
from lightning_gpipe.pipe.comm import nccl_order
from lightning_gpipe.pipe.comm.framing import LEN, Sizes, TensorMeta, layout, pack, unpack, wire
from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from lightning_gpipe.pipe.microbatch import differentiable

# How gloo and NCCL word a wait that ran out, and a peer that went away (NCCL's watchdog, ProcessGroupNCCL.cpp).
_TIMED_OUT = ("imed out", "before timing out")
_PEER_GONE = ("onnection", "remote process exiting", "communicator was aborted")
# How long a stage waits for a peer before raising PipelineTimeout, unless told otherwise (torch.distributed's default).
DEFAULT_TIMEOUT_S = 1800.0
# Tags keep headers apart from tensor bytes, input gradients (going upstream) apart from activations, the output
# apart from the chain's traffic, and long skips (``skips``) apart from all and from each other (``skip_tags``): two
# ranks may exchange activations and gradients in the same direction (interleaving at K = 2), each end in its own
# order of the two.
HEADER_TAG, DATA_TAG, OUTPUT_TAG, OUTPUT_DATA_TAG, GRAD_TAG, GRAD_DATA_TAG, SKIP_TAG = 0, 1, 2, 3, 4, 5, 6


def skip_tags(pair: int) -> tuple[int, int]:
    """The header tags of pair ``pair``'s skips and of their gradients (``skips.skip_pairs``; data: tag + 1)."""
    return SKIP_TAG + 4 * pair, SKIP_TAG + 4 * pair + 2


# A long skip's group for one direction of one pair of stages, and the peer's rank in it; by the data tag it carries.
SkipGroups = dict[int, tuple[dist.ProcessGroup, int]]
# A link's group for one direction, and the peer's rank in it; by (the sending stage, the receiving stage, whether
# it carries input gradients: only where a direction carries both kinds, else the activations' group carries all).
LinkGroups = dict[tuple[int, int, bool], tuple[dist.ProcessGroup, int]]


class _Slot:
    """Stands in a pickled structure for the i-th tensor of the message."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple:
        return (_Slot, (self.i,))


class PendingRecv:
    """A receive already posted; ``wait`` returns the structure or raises the error a peer sent instead."""

    def __init__(self, transport: Transport, src: int, tag: int, expect: list[TensorMeta] | None, what: str) -> None:
        self.transport, self.src, self.tag, self.expect, self.what = transport, src, tag, expect, what
        if transport._unread[src, tag] and transport.sizes_in.inline:
            raise RuntimeError(
                f"stage {transport.stage} posted a second receive from stage {src} on tag {tag} before reading the "
                "first: its size depends on the first one's (framing.Sizes)"
            )
        transport._unread[src, tag] += 1
        self.size = transport.sizes_in.size((src, tag))
        # Zeros: a length that is not 0 is a header arriving (see poll).
        self.header = torch.zeros(self.size, dtype=torch.uint8)
        self.header_work = transport._irecv(self.header, src, tag, header=True)
        self.tensors: list[torch.Tensor] = []
        self.works: list[Any] = []
        self._header_in = False  # its wait returned
        self._read: dict | None = None  # the header, once read
        # Where the tensors may come in the header's message, they are posted once it says they do not.
        self._posted = expect is not None and not transport.sizes_in.inline
        if expect is not None and self._posted:
            # The shapes are known (gradients of what this stage sent), so the bytes can flow before we ask for them.
            self._post_tensors(expect)

    def _post_tensors(self, metas: list[TensorMeta]) -> None:
        for meta in metas:
            t = torch.empty(meta.shape, dtype=meta.dtype, device=self.transport.device)
            self.tensors.append(t)
            if t.numel():
                self.works.append(self.transport._irecv(wire(t), self.src, self.tag + 1, header=False))

    def poll(self) -> None:
        """Post the tensors' receives if the header has come, without waiting: a receive posted ahead
        (``Transport.post_ahead``) then moves its bytes while this stage computes. Where the tensors may come in the
        header's message (framing), nothing: gloo moves the whole message whenever it comes."""
        if self._read is None and self.expect is None and not self.transport.sizes_in.inline and self._arriving():
            self._read_header(whole_only=True)

    def _arriving(self) -> bool:
        """Whether the header is here or on its way in. gloo reports a receive complete only from its ``wait()``, but
        its transports write the bytes into the buffer as they come: a length that is not 0 says the header is
        arriving, and the wait that follows is for the rest of one KiB at most."""
        return bool(self.header[: LEN.size].any()) or _ended(self.header_work)

    def _read_header(self, whole_only: bool = False) -> None:
        tr = self.transport
        if not self._header_in:  # never twice: a second wait on a gloo receive waits for another message
            tr._wait(self.header_work, f"the header of {self.what}", self.src)
            self._header_in = True
        raw = self.header.numpy()
        n = LEN.unpack(raw[: LEN.size].tobytes())[0]
        payload = raw[LEN.size : LEN.size + n].tobytes()
        if n > self.size - LEN.size:
            if whole_only:  # its second part is the next message on the tag: read where the caller waits
                return
            rest = torch.empty(n - (self.size - LEN.size), dtype=torch.uint8)
            tr._wait(tr._irecv(rest, self.src, self.tag, header=True), f"the header of {self.what}", self.src)
            payload += rest.numpy().tobytes()
        self._read = header = pickle.loads(payload)
        metas: list[TensorMeta] = header.get("metas", [])
        key = self.src, self.tag
        tr._unread[key] -= 1
        offsets, end = layout(n, metas)
        inline = tr.sizes_in.fits(self.size, metas, end)
        tr.sizes_in.record(key, end)
        if "error" in header:
            return
        if self.expect is not None and [(m.dtype, m.shape) for m in metas] != [(m.dtype, m.shape) for m in self.expect]:
            raise RuntimeError(
                f"stage {self.src} sent {metas} for {self.what}, but stage {tr.stage} expected {self.expect}"
            )
        if inline:
            self.tensors = unpack(self.header, metas, offsets)
            tr.bytes_received[self.src] += sum(t.numel() * t.element_size() for t in self.tensors)
        elif not self._posted:
            self._post_tensors(metas)

    def wait(self) -> tuple[Any, dict]:
        tr = self.transport
        if self._read is None:
            self._read_header()
        header = self._read
        assert header is not None, "read above"
        if "error" in header:
            err = PipelineError.from_wire(header["error"], received_by=tr.stage)
            err.via = self.src
            raise err
        for work in self.works:
            tr._wait(work, self.what, self.src, data=True)
        for t, meta in zip(self.tensors, header["metas"]):
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
        links: LinkGroups | None = None,
    ) -> None:
        self.group = group
        self.header_group = header_group if header_group is not None else group
        self.links: LinkGroups = dict(links or {})
        self.stage = dist.get_rank(group)
        self.device = device
        self.timeout = timeout
        # On NCCL a data wait is a CUDA stream's (work.wait() with a timeout would poll on the host).
        self.stream_waits = "nccl" in str(dist.get_backend(group)).lower()
        # A model of NCCL on gloo (NCCL itself needs none): one in-order queue per group, made at its first use.
        self._ordered: dict[str, nccl_order.OrderedP2P] = {}
        self._models_nccl = nccl_order.enabled() and not self.stream_waits
        # Each message's size, agreed by both ends (framing): with the tensors beside the header where the data
        # travels on gloo too (CPU processes, no model of NCCL's order, which the data groups alone follow).
        inline = not self.stream_waits and not self._models_nccl and device.type == "cpu"
        self.sizes_out, self.sizes_in = Sizes(inline), Sizes(inline)
        self._unread: Counter[tuple[int, int]] = Counter()  # receives posted and not yet read, by (source, tag)
        # Receives posted ahead (post_ahead) where a receive posted after a compute would wait for it: on NCCL (and
        # its model). On gloo the gain is within the noise and its failure paths are not ready for it
        # (benchmarks/results/receive_ahead/README.md).
        self.posts_ahead = self.stream_waits or self._models_nccl
        # (work, buffer, peer, whether it is tensor data): kept until the peer received it.
        self._pending_sends: list[tuple[Any, torch.Tensor, int, bool]] = []
        self._data_aborted = False  # after a failure (abort_data): every data group, used or not
        # Receives posted ahead of the call that takes them, by (source, tag), in posting order (see post_ahead).
        self._ahead: dict[tuple[int, int], deque[PendingRecv]] = defaultdict(deque)
        # Long skips' own groups by data tag (see add_skip_groups).
        self._skip_groups: SkipGroups = {}
        # Tensor bytes by peer stage, since the transport was made: what each link carried, measured.
        self.bytes_sent: Counter[int] = Counter()
        self.bytes_received: Counter[int] = Counter()

    def add_skip_groups(self, groups: SkipGroups) -> None:
        """Send the tensors of each data tag in ``groups`` on its group (``groups.skip_groups``, made where transfers
        run in posting order; elsewhere the pipeline group's tags keep them apart)."""
        self._skip_groups.update(groups)

    def _data_group(self, src: int, dst: int, tag: int) -> tuple[str, dist.ProcessGroup, int]:
        """The group a tensor from stage ``src`` to stage ``dst`` travels on, its name, and the peer's rank in it."""
        if tag in self._skip_groups:
            group, rank = self._skip_groups[tag]
            return f"skip tag {tag}", group, rank
        gradients = tag == GRAD_DATA_TAG and (src, dst, True) in self.links
        if (src, dst, gradients) in self.links:
            group, rank = self.links[src, dst, gradients]
            return f"{src} → {dst}" + (" (gradients)" if gradients else ""), group, rank
        return "pipeline", self.group, dst if src == self.stage else src

    def _queue(self, name: str, group: dist.ProcessGroup) -> nccl_order.OrderedP2P:
        if name not in self._ordered:
            self._ordered[name] = nccl_order.OrderedP2P(group, name, self.timeout.total_seconds())
            if self._data_aborted:  # a group not used before the failure is aborted with the others
                self._ordered[name].abort()
        return self._ordered[name]

    def _irecv(self, buf: torch.Tensor, src: int, tag: int, header: bool) -> Any:
        if header:
            return dist.irecv(buf, group=self.header_group, group_src=src, tag=tag)
        self.bytes_received[src] += buf.numel()
        name, group, peer = self._data_group(src, self.stage, tag)
        if self._models_nccl:
            return self._queue(name, group).irecv(buf, peer)
        return dist.irecv(buf, group=group, group_src=peer, tag=tag)

    def _isend(self, buf: torch.Tensor, dst: int, tag: int, header: bool) -> None:
        name, group, peer = ("", self.header_group, dst) if header else self._data_group(self.stage, dst, tag)
        work: Any
        try:
            if not header and self._models_nccl:
                work = self._queue(name, group).isend(buf, peer)
            else:
                work = dist.isend(buf, group=group, group_dst=peer, tag=tag)
        except RuntimeError as e:
            raise self._lost(e, f"stage {dst} to take a message", dst) from e
        if not header:
            self.bytes_sent[dst] += buf.numel()
        # The handle must stay referenced until the peer received it: dropping a gloo send's handle cancels it.
        self._pending_sends.append((work, buf, dst, not header))

    def _lost(self, e: RuntimeError, waited_for: str, peer: int) -> RuntimeError:
        text = str(e)
        if any(s in text for s in _TIMED_OUT):
            return PipelineTimeout(
                f"stage {self.stage} waited {self.timeout.total_seconds():.0f} s for {waited_for} and gave up. "
                f"Stage {peer} probably died, hung, or did not make the same pipeline call: a pipelined module must "
                "be called (and its backward run) on every stage of the pipeline, never on one rank only",
                stage=peer,
                phase="transport",
            )
        if any(s in text for s in _PEER_GONE):
            return PipelineTimeout(
                f"stage {self.stage} lost its connection to stage {peer} while waiting for {waited_for}: the "
                f"process of stage {peer} probably died (look for its error above, or for an out-of-memory kill), "
                "or ended without making the same pipeline call: a pipelined module must be called on every stage "
                "of the pipeline, never on one rank only",
                stage=peer,
                phase="transport",
            )
        return e

    def _wait(self, work: Any, what: str, peer: int, data: bool = False) -> None:
        try:
            if data and self.stream_waits:
                work.wait()
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e, f"{what} from stage {peer}", peer) from e

    def _send_header(self, dst: int, header: dict, tag: int, tensors: list[torch.Tensor] | None = None) -> bool:
        """Queue the header, with ``tensors``' bytes in its message where they fit; whether they did."""
        payload = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        metas: list[TensorMeta] = header.get("metas", [])
        key, (offsets, end) = (dst, tag), layout(len(payload), metas)
        size = self.sizes_out.size(key)
        inline = self.sizes_out.fits(size, metas, end)
        self._isend(pack(payload, size, *((tensors or [], offsets) if inline else ())), dst, tag, header=True)
        if len(payload) > size - LEN.size:
            rest = payload[size - LEN.size :]
            self._isend(torch.frombuffer(bytearray(rest), dtype=torch.uint8), dst, tag, header=True)
        self.sizes_out.record(key, end)
        return inline

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
        if self._send_header(dst, {"skeleton": skeleton, "metas": metas, "fields": fields}, tag, tensors):
            self.bytes_sent[dst] += sum(t.numel() * t.element_size() for t in tensors)
            return metas
        for t in tensors:
            if t.numel():
                self._isend(wire(t), dst, tag + 1, header=False)
        return metas

    def post_recv(
        self, src: int, what: str, *, tag: int = HEADER_TAG, expect: list[TensorMeta] | None = None
    ) -> PendingRecv:
        """The next receive from stage ``src`` on ``tag``: the one posted ahead for it, else one posted now."""
        ahead = self._ahead.get((src, tag))
        if ahead:
            if expect is not None:
                raise RuntimeError(f"a receive posted ahead from stage {src} was taken for {what}, of known shapes")
            pending = ahead.popleft()
            pending.what = what
            return pending
        return PendingRecv(self, src, tag, expect, what)

    def post_ahead(self, src: int, what: str, *, tag: int = HEADER_TAG) -> None:
        """Post now the receive that the next ``post_recv(src, tag=tag)`` will take: its header at once, its tensors at
        the first :meth:`poll` after the header came. The caller knows that no other receive from ``src`` on ``tag``
        comes between (gloo and NCCL match a peer's messages in order). Where ``posts_ahead`` is False, nothing:
        the receive is posted where it is taken."""
        if self.posts_ahead:
            self._ahead[src, tag].append(PendingRecv(self, src, tag, None, what))

    def poll(self) -> None:
        """Post the tensors of every receive posted ahead whose header has come; never blocks."""
        for ahead in self._ahead.values():
            for pending in ahead:
                pending.poll()

    def recv(self, src: int, what: str, *, tag: int = HEADER_TAG) -> tuple[Any, dict]:
        return self.post_recv(src, what, tag=tag).wait()

    def send_error(self, dst: int, error: PipelineError, tag: int = HEADER_TAG) -> None:
        self._send_header(dst, {"error": error.to_wire()}, tag)

    def retire_sends(self) -> None:
        """Drop the sends the peers have received, releasing their buffers; never blocks."""
        self._pending_sends = [s for s in self._pending_sends if not _ended(s[0])]

    def unreceived(self) -> list[int]:
        """The stages that have not yet received something this stage sent them (asked once a wait failed: gloo
        reports a send complete only from its ``wait()``, so each of its sends gets a short one, which ends it)."""
        return sorted({d for w, _, d, data in self._pending_sends if not self._received(w, data)})

    def _received(self, work: Any, data: bool) -> bool:
        if _ended(work):
            return True
        if data and self.stream_waits:  # NCCL's answer above is the truth; its wait would block the host
            return False
        try:
            return bool(work.wait(timedelta(milliseconds=20)))
        except RuntimeError:
            return False

    def wait_sends(self) -> None:
        """Wait until the peers received every send (on NCCL, the stream waits for the data: no host sync)."""
        for work, _, dst, data in self._pending_sends:
            try:
                work.wait() if data and self.stream_waits else work.wait(self.timeout)
            except RuntimeError as e:
                raise self._lost(e, f"stage {dst} to receive a message", dst) from e
        self._pending_sends.clear()

    def abort_data(self) -> None:
        """After a failure: cancel every transfer this rank posted on the data groups, and any later one.

        NCCL would otherwise keep receives posted ahead of the failure (and the kernels waiting on them) until its
        watchdog fires; the groups are not used again (the pipeline refuses to run after a failure). They are aborted
        together, as torch aborts its own (one communicator's abort can wait on another's, pytorch#119797). The
        pipeline's group, where the links carried the tensors, and the world's are left alone: aborting them would
        take every later collective on them (Lightning's teardown) with it. Headers (error notices among them) still
        go out."""
        self._data_aborted = True
        for ordered in self._ordered.values():
            ordered.abort()
        if self.stream_waits:
            data = [g for g, _ in (*self.links.values(), *self._skip_groups.values())]
            if not self.links and self.group is not dist.group.WORLD:  # with links no tensor travelled on it
                data.append(self.group)
            abort_together(list({id(g): g for g in data}.values()), self.device)
        self._pending_sends = [s for s in self._pending_sends if not s[3]]
        self._ahead.clear()

    def abandon_sends(self, grace_s: float = 2.0) -> None:
        """Forget sends no peer will receive (after a failure); the process group should not be reused.

        A peer may be receiving one right now (stage 0 reading the output the last stage sent just before it failed):
        polled, not waited on, for up to ``grace_s`` so that the peer gets it and fails on its own instead of hanging.
        """
        deadline = time.monotonic() + grace_s
        while any(not _ended(s[0]) for s in self._pending_sends) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._pending_sends.clear()


def _ended(work: Any) -> bool:
    """Whether ``work`` will do nothing more: completed, or failed (after an asynchronous CUDA error NCCL's
    ``is_completed`` raises it, which must not stop a failure handler from telling the other stages)."""
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return True
