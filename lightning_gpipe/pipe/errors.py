"""Errors a pipeline raises on every rank when one stage fails, naming the stage and the error; argument choices."""

from __future__ import annotations

import traceback
from typing import TypeVar

T = TypeVar("T")


def one_of(value: object, choices: tuple[T, ...], argument: str) -> T:
    """``value`` as the one of ``choices`` it equals, or a ValueError naming the ``argument`` that gave it."""
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"{argument}={value!r} is not one of {list(choices)}")


class PipelineError(RuntimeError):
    """A stage of the pipeline failed; raised on the failing rank and, by propagation, on every other one."""

    def __init__(self, message: str, *, stage: int, phase: str, remote_traceback: str = "", note: str = "") -> None:
        super().__init__(message + note)
        self.message = message  # without the note a receiving stage adds, so forwarding does not repeat it
        self.stage = stage
        self.phase = phase
        self.remote_traceback = remote_traceback
        self.via: int | None = None  # the neighbour stage that passed this error on, if it was received
        self.settled = False  # True once every stage of the pipeline knows about it

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, stage: int, phase: str, micro_batch: int | None, chunk: str | None = None
    ) -> PipelineError:
        where = f"stage {stage} failed in the {phase} phase"
        if micro_batch is not None:
            where += f" (micro-batch {micro_batch}" + (f", {chunk})" if chunk else ")")
        return cls(
            f"{where}: {type(exc).__name__}: {exc}",
            stage=stage,
            phase=phase,
            remote_traceback="".join(traceback.format_exception(exc)),
        )

    def to_wire(self) -> dict:
        return {"message": self.message, "stage": self.stage, "phase": self.phase, "traceback": self.remote_traceback}

    @classmethod
    def from_wire(cls, wire: dict, *, received_by: int) -> PipelineError:
        note = ""
        if wire["stage"] != received_by:
            note = f"\n(reported to stage {received_by}; the original traceback of stage {wire['stage']}:)\n"
            note += wire["traceback"]
        return cls(
            wire["message"], stage=wire["stage"], phase=wire["phase"], remote_traceback=wire["traceback"], note=note
        )


class PipelineTimeout(PipelineError):
    """A stage waited longer than the timeout for a peer, or lost its connection: the peer died, hung, or skipped
    a pipeline call. ``stage`` is the peer. Nothing more can cross that connection, so no status check follows."""
