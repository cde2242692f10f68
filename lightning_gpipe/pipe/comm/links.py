"""A stage's traffic with its peers: messages over the transport, each timed on the timeline, and the status check."""

from __future__ import annotations

from typing import Any

import torch

from lightning_gpipe.pipe._torch_internals import tree_map
from lightning_gpipe.pipe.comm.framing import TensorMeta
from lightning_gpipe.pipe.comm.status import StatusCheck
from lightning_gpipe.pipe.comm.transport import OUTPUT_TAG, Transport, skip_tags
from lightning_gpipe.pipe.microbatch import differentiable, tensors
from lightning_gpipe.pipe.skips import StageSkips
from lightning_gpipe.pipe.trace.events import Timeline


class Links:
    """Stage ``index``'s links to the other stages of its pipeline; only a distributed stage has them."""

    def __init__(self, transport: Transport, status: StatusCheck, index: int, timeline: Timeline) -> None:
        self.transport = transport
        self.status = status
        self.index = index
        self.timeline = timeline
        # What a chunk hands another chunk of this rank: (from stage, to stage, m, whether gradients) -> tensors.
        self._handed: dict[tuple[int, int, int, bool], Any] = {}
        # The same for activations and input gradients between adjacent stages of this rank (a V's middle), with
        # their header's fields; apart from the skips, which may join the same two stages.
        self._adjacent: dict[tuple[int, int, int, bool], tuple[Any, dict[str, Any]]] = {}

    def send(
        self, dst: int, obj: Any, micro_batch: int, chunk: int = -1, *, label: str = "", **kwargs: Any
    ) -> list[TensorMeta]:
        """Queue ``obj`` for stage ``dst`` (see :meth:`Transport.send`) and drop the sends already received;
        ``label`` names it in the timeline (``"gradient"``: an input gradient, going upstream)."""
        with self.timeline.record("send", micro_batch, label=label, chunk=chunk):
            metas = self.transport.send(dst, obj, **kwargs)
            self.transport.retire_sends()
        return metas

    def hand(
        self, src: int, dst: int, micro_batch: int, obj: Any, marks: list[bool], gradients: bool = False, **fields: Any
    ) -> list[TensorMeta]:
        """Hand ``obj`` from stage ``src`` to stage ``dst``, both on this rank, as :meth:`send` would deliver it: fresh
        leaves, differentiated where ``marks`` say; :meth:`take` gives it with ``fields``."""
        metas = [TensorMeta(t.dtype, tuple(t.shape), mark) for t, mark in zip(tensors(obj), marks)]
        wants = iter(marks)
        leaf = lambda t: t.detach().requires_grad_(next(wants) and differentiable(t))  # noqa: E731
        self._adjacent[src, dst, micro_batch, gradients] = (
            tree_map(lambda x: leaf(x) if isinstance(x, torch.Tensor) else x, obj),
            fields,
        )
        return metas

    def take(self, src: int, dst: int, m: int, gradients: bool = False) -> tuple[Any, dict[str, Any]]:
        """What stage ``src`` handed stage ``dst`` (both on this rank) for micro-batch m, with its header's fields."""
        key = src, dst, m, gradients
        if key not in self._adjacent:
            what = "output gradient" if gradients else "input"
            raise RuntimeError(
                f"stage {dst} needs micro-batch {m}'s {what} from stage {src}, on this rank, which has not run that "
                "micro-batch yet: the schedule runs the two chunks of this rank out of order"
            )
        return self._adjacent.pop(key)

    def post_take(self, src: int, dst: int, m: int) -> Any:
        """The output gradient that stage ``src`` will hand stage ``dst`` (both on this rank) for micro-batch m, as a
        posted receive gives it: ``wait()`` takes it."""
        return _Taken(self, (src, dst, m))

    def receive(
        self,
        m: int,
        training: bool,
        src: int | None = None,
        stage: int | None = None,
        chunk: int = -1,
        local: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header fields: M, its size n, the step seed.

        With several virtual stages per rank the previous stage ``stage - 1`` is on rank ``src`` (``local``: on this
        rank, handed over); by default this rank is stage ``index`` and the previous one is rank ``index - 1``."""
        src = self.index - 1 if src is None else src
        stage = self.index if stage is None else stage
        if local:
            x, fields = self.take(stage - 1, stage, m)
        else:
            with self.timeline.record("recv-wait", m, chunk=chunk):
                x, fields = self.transport.recv(src, f"micro-batch {m}'s input")
        check_header(fields, m, stage - 1, stage, "input")
        if fields["training"] != training:
            modes = {True: "a training forward phase (grad enabled)", False: "a forward-only pass (no grad)"}
            raise RuntimeError(
                f"stage {stage - 1} ran {modes[fields['training']]} while stage {stage} ran "
                f"{modes[training]}; every stage must call the pipelined module in the same grad mode"
            )
        return x, fields

    def receive_ahead(self, m: int, src: int | None = None) -> None:
        """Post micro-batch m's input receive from rank ``src`` (default: the previous) now, for :meth:`receive` to
        take: its tensors' receives are posted as soon as its header has come (:meth:`poll`), so that its bytes move
        while this stage computes. Only where it is the next receive from that rank (the runners know)."""
        self.transport.post_ahead(self.index - 1 if src is None else src, f"micro-batch {m}'s input")

    def poll(self) -> None:
        """Post the tensors of the receives posted ahead whose headers came (before a compute is queued: on NCCL
        a receive posted after it waits for it on the stream)."""
        self.transport.poll()

    def receive_skips(self, m: int, skips: StageSkips, chunk: int = -1) -> dict[int, list[Any]]:
        """Micro-batch m's long skips from earlier stages, by stage (see ``skips``); called after its input came,
        which brings a failure upstream first."""
        got = {}
        for src, names in skips.receives.items():
            if skips.local(src):
                got[src] = self._handed.pop((src, skips.index, m, False))
                continue
            with self.timeline.record("recv-wait", m, label="skip", chunk=chunk):
                what = f"micro-batch {m}'s skips {list(names)}"
                got[src], fields = self.transport.recv(skips.rank_of(src), what, tag=skip_tags(skips.pairs[src])[0])
            check_header(fields, m, src, skips.index, "skips")
        return got

    def send_skips(
        self, dst: int, values: list[Any], marks: list[bool], chunk: int, fields: dict[str, Any], skips: StageSkips
    ) -> list[TensorMeta]:
        """Queue long skips for stage ``dst`` with the header ``fields`` (``marks``: those it sends a gradient back
        for), or hand them over to another chunk of this rank as the transport delivers them: fresh leaves."""
        metas = [TensorMeta(t.dtype, tuple(t.shape), mark) for t, mark in zip(tensors(values), marks)]
        if skips.local(dst):
            wants = iter(marks)
            leaf = lambda t: t.detach().requires_grad_(next(wants) and differentiable(t))  # noqa: E731
            self._handed[(skips.index, dst, fields["m"], False)] = tree_map(
                lambda x: leaf(x) if isinstance(x, torch.Tensor) else x, values
            )
            return metas
        tag = skip_tags(skips.pairs[dst])[0]
        self.send(skips.rank_of(dst), values, fields["m"], chunk, label="skip", tag=tag, requires_grad=marks, **fields)
        return metas

    def post_skip_grads(self, dst: int, m: int, expect: list[TensorMeta], skips: StageSkips) -> Any:
        """The gradients of micro-batch m's skips that stage ``dst`` popped, posted now; ``wait()`` gives them and the
        header's fields."""
        if skips.local(dst):
            return _Handed(self._handed, (dst, skips.index, m, True), {"m": m, "stage": dst})
        what, tag = f"micro-batch {m}'s skip gradients", skip_tags(skips.pairs[dst])[1]
        return self.transport.post_recv(skips.rank_of(dst), what, tag=tag, expect=expect)

    def send_skip_grads(self, src: int, grads: list[torch.Tensor], m: int, chunk: int, skips: StageSkips) -> None:
        """Micro-batch m's gradients of the skips received from stage ``src``, back to it."""
        if skips.local(src):
            self._handed[(skips.index, src, m, True)] = grads
            return
        tag, marks = skip_tags(skips.pairs[src])[1], [False] * len(grads)
        self.send(
            skips.rank_of(src), grads, m, chunk, label="skip gradient", tag=tag, requires_grad=marks, m=m,
            stage=skips.index,
        )  # fmt: skip

    def receive_output(self, src: int) -> Any:
        """The pipeline's output, shared by stage ``src`` (the last) on the output tag."""
        with self.timeline.record("recv-wait", -1, label="output"):
            shared, _ = self.transport.recv(src, "the pipeline's output", tag=OUTPUT_TAG)
        return shared

    def check_status(self) -> None:
        """Return once every stage finished the phase; raise the failure of a stage that did not."""
        self.status.check(None, self.transport.unreceived)


def check_header(fields: dict[str, Any], m: int, sender: int, receiver: int, what: str) -> None:
    """The message stage ``receiver`` got is micro-batch m's ``what`` from stage ``sender``, as its header says."""
    # gloo matches by order alone: a stage on another schedule (or with other chunks) would get the wrong data.
    got_m, got_stage = fields.get("m", m), fields.get("stage", sender)
    if (got_m, got_stage) != (m, sender):
        instead = f" instead of stage {sender}'s" if got_stage != sender else ""
        raise RuntimeError(
            f"stage {receiver} waited for micro-batch {m}'s {what} and got micro-batch {got_m}'s from stage "
            f"{got_stage}{instead}: the stages run their micro-batches in different orders (every stage must run the "
            "same schedule, with the same M and the same virtual_stages)"
        )


class _Handed:
    """The gradients another chunk of this rank handed over, as a posted receive gives them."""

    def __init__(self, handed: dict[tuple[int, int, int, bool], Any], key: tuple[int, int, int, bool], fields: dict):
        self.handed, self.key, self.fields = handed, key, fields

    def wait(self) -> tuple[Any, dict[str, Any]]:
        return self.handed.pop(self.key), self.fields


class _Taken:
    """An output gradient that another chunk of this rank hands over (``Links.hand``), as a posted receive gives it."""

    def __init__(self, links: Links, key: tuple[int, int, int]) -> None:
        self.links, self.key = links, key

    def wait(self) -> tuple[Any, dict[str, Any]]:
        return self.links.take(*self.key, gradients=True)
