"""A stage's traffic with its peers: messages over the transport, each timed on the timeline, and the status check."""

from __future__ import annotations

from typing import Any

from lightning_gpipe.pipe.status import StatusCheck
from lightning_gpipe.pipe.trace import Timeline
from lightning_gpipe.pipe.transport import OUTPUT_TAG, TensorMeta, Transport


class Links:
    """Stage ``index``'s links to the other stages of its pipeline; only a distributed stage has them."""

    def __init__(self, transport: Transport, status: StatusCheck, index: int, timeline: Timeline) -> None:
        self.transport = transport
        self.status = status
        self.index = index
        self.timeline = timeline

    def send(self, dst: int, obj: Any, micro_batch: int, **kwargs: Any) -> list[TensorMeta]:
        """Queue ``obj`` for stage ``dst`` (see :meth:`Transport.send`) and drop the sends already received."""
        with self.timeline.record("send", micro_batch):
            metas = self.transport.send(dst, obj, **kwargs)
            self.transport.retire_sends()
        return metas

    def receive(self, m: int, training: bool) -> tuple[Any, dict[str, Any]]:
        """Micro-batch m's input from the previous stage, with its header fields: M, its size n, the step seed."""
        with self.timeline.record("recv-wait", m):
            x, fields = self.transport.recv(self.index - 1, f"micro-batch {m}'s input")
        if fields["m"] != m:  # gloo matches by order alone: a stage on another schedule would get the wrong data
            raise RuntimeError(
                f"stage {self.index} waited for micro-batch {m}'s input and got micro-batch {fields['m']}'s from "
                f"stage {self.index - 1}: the stages run their micro-batches in different orders (every stage must "
                "run the same schedule, with the same M)"
            )
        if fields["training"] != training:
            modes = {True: "a training forward phase (grad enabled)", False: "a forward-only pass (no grad)"}
            raise RuntimeError(
                f"stage {self.index - 1} ran {modes[fields['training']]} while stage {self.index} ran "
                f"{modes[training]}; every stage must call the pipelined module in the same grad mode"
            )
        return x, fields

    def receive_output(self, src: int) -> Any:
        """The pipeline's output, shared by stage ``src`` (the last) on the output tag."""
        with self.timeline.record("recv-wait", -1, label="output"):
            shared, _ = self.transport.recv(src, "the pipeline's output", tag=OUTPUT_TAG)
        return shared

    def check_status(self) -> None:
        """Return once every stage finished the phase; raise the failure of a stage that did not."""
        self.status.check(None, self.transport.unreceived)
