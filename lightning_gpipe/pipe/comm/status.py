"""End-of-phase agreement: every stage learns whether the whole pipeline succeeded, and if not, which stage failed."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout


class StatusCheck:
    """One small all-reduce per phase over the pipeline group (its CPU group).

    A stage that fails sends its error to its neighbours, which wakes those that wait for it; the stages that do not
    wait for it (those behind it in that phase's direction) finish the phase normally. Both then meet here, so no
    rank returns successfully from a step that failed elsewhere.
    """

    def __init__(self, group: dist.ProcessGroup, stage: int, timeout: timedelta) -> None:
        self.group = group
        self.stage = stage
        self.timeout = timeout

    def check(self, err: PipelineError | None, unreceived: Callable[[], list[int]] = list) -> None:
        """Raise on every stage if any stage failed; ``unreceived`` names stages that never took our messages."""
        flag = torch.tensor([0 if err is None else err.stage + 1], dtype=torch.int64)
        start = time.monotonic()
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e, time.monotonic() - start, unreceived()) from e
        if int(flag) == 0:
            return
        wires: list[dict | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(wires, None if err is None else err.to_wire(), group=self.group)
        if err is None:
            origin = int(flag) - 1
            wire = next((w for w in wires if w is not None and w["stage"] == origin), None)
            wire = wire or next(w for w in wires if w is not None)
            err = PipelineError.from_wire(wire, received_by=self.stage)
        err.settled = True
        raise err

    def _lost(self, e: RuntimeError, elapsed: float, missing: list[int]) -> PipelineTimeout:
        timeout = self.timeout.total_seconds()
        # A wait that ended well before the timeout did not time out: a peer's connection closed (it died or
        # exited), and saying "waited 60 s" would send the reader looking for a hang.
        if elapsed < 0.9 * timeout:
            who = f"stage {missing[0]}" if missing else "a peer"
            return PipelineTimeout(
                f"stage {self.stage} lost its connection to the other stages after {elapsed:.2f} s, while waiting for "
                f"them to finish the phase: the process of {who} probably died or exited (look for its error above, "
                f"or for an out-of-memory kill). The underlying error: {e}",
                stage=missing[0] if missing else self.stage,
                phase="status",
            )
        suspect = (
            f"stage {missing[0]} never received what stage {self.stage} sent it, so it probably skipped this "
            "call (e.g. backward() on some stages only), hung, or died"
            if missing
            else "one of them probably skipped this call, hung, or died"
        )
        return PipelineTimeout(
            f"stage {self.stage} waited {timeout:.0f} s for the other stages to finish the phase; {suspect}",
            stage=missing[0] if missing else self.stage,
            phase="status",
        )
