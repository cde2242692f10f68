"""How a stage fails: any error becomes a PipelineError that reaches every stage, and the pipeline stays unusable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from lightning_gpipe.pipe.transport import OUTPUT_TAG


class FailureHandling:
    """Mixed into GPipeStage: the error paths of its phases, kept apart from the schedule that runs them."""

    _broken: PipelineError | None
    _step: Any
    _transport: Any
    _status: Any
    _k: int
    _K: int
    _output_mode: str
    timeline: Any
    is_last: bool

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                "this pipeline failed earlier and its process group is in an unknown state; "
                f"restart the processes. The earlier failure: {self._broken}"
            )

    @contextmanager
    def _phase(self, phase: str) -> Iterator[list[int | None]]:
        """Turns any error into a PipelineError that reaches every stage, then checks that all stages succeeded."""
        self._check_usable()
        where: list[int | None] = [None]  # the micro-batch being worked on, for the error message
        try:
            with self.timeline.record("step", label=phase):
                yield where
        except Exception as e:
            err = (
                e
                if isinstance(e, PipelineError)
                else PipelineError.from_exception(e, stage=self._k, phase=phase, micro_batch=where[0])
            )
            self._fail(err, phase)
            if err is e:
                raise
            raise err from e

    def _fail(self, err: PipelineError, phase: str) -> None:
        self._broken = err
        self._step = None
        tr = self._transport
        if tr is None or err.settled:
            return  # a settled error came out of the status check: every stage knows already
        # Before queuing the error notices: dropping a gloo send's handle cancels it. A silent peer reads nothing.
        tr.abandon_sends(grace_s=0.0 if isinstance(err, PipelineTimeout) else 2.0)
        # Wake the neighbours that may wait for this stage; whoever receives it passes it on.
        for dst in (self._k - 1, self._k + 1):
            if 0 <= dst < self._K and dst != err.via:
                self._notify(dst, err)
        if self.is_last and self._output_mode != "last" and phase in ("forward", "evaluation"):
            for dst in range(self._K - 1):
                self._notify(dst, err, tag=OUTPUT_TAG)
        # Every stage that raises meets the others here, which also keeps this process alive until its notices are
        # delivered. Not after a timeout or a lost peer: the check would only wait for the same silent peer again.
        if self._status is not None and not isinstance(err, PipelineTimeout):
            self._status.check(err)  # raises err once every stage knows

    def _notify(self, dst: int, err: PipelineError, tag: int = 0) -> None:
        # Best effort: if that peer's process is gone already, nobody waits on this message.
        with suppress(RuntimeError):
            self._transport.send_error(dst, err, tag=tag)

    def _status_checked(self, phase: str) -> bool:
        # The output broadcast already tells every stage how a forward phase ended.
        return self._status is not None and (phase == "backward" or self._output_mode == "last")

    def abort(self, exc: BaseException) -> None:
        """Report a failure outside the pipelined module (e.g. in the loss) to every stage, then raise it."""
        phase = "backward" if self._step is not None else "forward"
        err = PipelineError.from_exception(exc, stage=self._k, phase="step", micro_batch=None)
        self._fail(err, phase)
        raise err from exc
