"""A stage's traffic with its peers: messages over the transport, each timed on the timeline, and the status check."""

from __future__ import annotations

from typing import Any

from lightning_gpipe.pipe.skips import StageSkips
from lightning_gpipe.pipe.status import StatusCheck
from lightning_gpipe.pipe.trace import Timeline
from lightning_gpipe.pipe.transport import OUTPUT_TAG, SKIP_TAG, TensorMeta, Transport


class Links:
    """Stage ``index``'s links to the other stages of its pipeline; only a distributed stage has them."""

    def __init__(self, transport: Transport, status: StatusCheck, index: int, timeline: Timeline) -> None:
        self.transport = transport
        self.status = status
        self.index = index
        self.timeline = timeline

    def send(
        self, dst: int, obj: Any, micro_batch: int, chunk: int = -1, *, label: str = "", **kwargs: Any
    ) -> list[TensorMeta]:
        """Queue ``obj`` for stage ``dst`` (see :meth:`Transport.send`) and drop the sends already received;
        ``label`` names it in the timeline (``"gradient"``: an input gradient, going upstream)."""
        with self.timeline.record("send", micro_batch, label=label, chunk=chunk):
            metas = self.transport.send(dst, obj, **kwargs)
            self.transport.retire_sends()
        return metas

    def receive(
        self, m: int, training: bool, src: int | None = None, stage: int | None = None, chunk: int = -1
    ) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header fields: M, its size n, the step seed.

        With several chunks per rank (interleaving) the previous stage ``stage - 1`` is on rank ``src``; by default
        this rank is stage ``index`` and the previous one is rank ``index - 1``."""
        src = self.index - 1 if src is None else src
        stage = self.index if stage is None else stage
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

    def receive_skips(self, m: int, skips: StageSkips, chunk: int = -1) -> dict[int, list[Any]]:
        """Micro-batch m's long skips from earlier stages, by stage (see ``skips``); called after its input came,
        which brings a failure upstream first."""
        got = {}
        for src, names in skips.receives.items():
            with self.timeline.record("recv-wait", m, label="skip", chunk=chunk):
                got[src], fields = self.transport.recv(src, f"micro-batch {m}'s skips {list(names)}", tag=SKIP_TAG)
            check_header(fields, m, src, skips.index, "skips")
        return got

    def send_skips(
        self, dst: int, values: list[Any], marks: list[bool], chunk: int, fields: dict[str, Any]
    ) -> list[TensorMeta]:
        """Queue long skips for stage ``dst`` (``marks``: those it sends a gradient back for), or their gradients
        for the stage they came from (no marks), with the header ``fields``."""
        gradient = dst < self.index
        return self.send(
            dst, values, fields["m"], chunk, label="skip gradient" if gradient else "skip", tag=SKIP_TAG,
            requires_grad=marks, **fields,
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
