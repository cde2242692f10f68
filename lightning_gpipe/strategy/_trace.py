"""GPipeStrategy(trace_dir=...): chosen training steps written as one Chrome trace and one Gantt chart per step."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.trace.events import Mark, gather_events, write_chrome_trace
from lightning_gpipe.pipe.trace.stats import summary_line
from lightning_gpipe.strategy._mesh import PipelineMesh

Closure = Callable[[], Any]
OptimizerStep = Callable[[Closure], Any]  # the strategy's own optimizer_step, given the closure


class StepTracer:
    """GPipeStrategy(trace_dir=...): turns the stage's timeline on for the chosen steps and writes them out.

    A traced step runs from the first ``training_step`` of an optimizer step (all its accumulation micro-steps
    included) to the end of ``optimizer_step``. Only the first data-parallel replica traces, so the others run
    undisturbed; its stages meet in a barrier first and measure time from there: stages on stage 0's host from
    its origin (one clock, exact), stages on other hosts from their own (to within the barrier's skew). Stage 0
    writes ``step_<N>.json`` (chrome://tracing, Perfetto; the time breakdown in its ``otherData``) and
    ``step_<N>.png``.
    """

    def __init__(self, trace_dir: str | None, steps: tuple[int, ...]) -> None:
        self.dir = None if trace_dir is None else Path(trace_dir)
        self.steps = steps
        self.traced: tuple[int, ...] = ()
        self._origin: int | None = None
        self._step = -1

    def begin(self, stage: GPipeStage, mesh: PipelineMesh, step: int) -> None:
        """At the start of every training_step: start tracing if this optimizer step was asked for."""
        if self.dir is None or self._origin is not None:
            return
        if step not in self.steps or step in self.traced or dist.get_rank(mesh.dp_group) != 0:
            return
        timeline = stage.timeline
        timeline.clear()
        timeline.enabled = True
        timeline.anchor()  # between steps: the previous step's queued GPU work done, where device and host clocks meet
        dist.barrier(group=mesh.header_group)
        self._origin, self._step = _shared_origin(time.perf_counter_ns(), mesh.header_group), step

    def loss(self, stage: GPipeStage) -> None:
        """Just before the backward phase: the time since the forward phase ended went to the loss."""
        timeline = stage.timeline
        if self._origin is None or not timeline.enabled:
            return
        forward_end = timeline.end_of("step", "forward")
        if forward_end is not None:
            timeline.add("loss", forward_end, timeline.mark())

    def optimizer_step(self, stage: GPipeStage, mesh: PipelineMesh, step: OptimizerStep, closure: Closure) -> Any:
        """``step(closure)``, the optimizer step, timed as the update and ending a traced step."""
        if self.dir is None:
            return step(closure)
        # The closure may run the step's training_step, and so start the trace: whether to end it is known after.
        closed: list[Mark] = []
        timeline = stage.timeline

        def timed_closure() -> Any:
            result = closure()
            closed.append(timeline.mark())  # the update (clipping and the step) starts here
            return result

        start = timeline.mark()
        out = step(timed_closure)
        if self._origin is not None:
            timeline.add("update", closed[-1] if closed else start, timeline.mark())
            self._end(stage, mesh.header_group, self.dir)
        return out

    def _end(self, stage: GPipeStage, header_group: dist.ProcessGroup, out: Path) -> None:
        timeline, origin = stage.timeline, self._origin
        assert origin is not None
        timeline.enabled, self._origin = False, None
        step = self._step
        self.traced = (*self.traced, step)
        events = gather_events(timeline, header_group, origin_ns=origin)
        timeline.clear()
        if not stage.is_first:
            return
        from lightning_gpipe.pipe.trace.gantt import plot_timeline

        out.mkdir(parents=True, exist_ok=True)
        stats = plot_timeline(events, out / f"step_{step}.png", f"step {step}", stage.placement)
        write_chrome_trace(events, out / f"step_{step}.json", metadata={"step": step, **stats})
        rank_zero_info(f"GPipe trace of step {step} in {out}: {summary_line(stats)}")

    def end_of_fit(self, mesh: PipelineMesh, step: int) -> None:
        """Name the chosen steps that never ran (``step``: the one the fit ended at)."""
        missed = sorted(set(self.steps) - set(self.traced))
        if self.dir is not None and missed and dist.get_rank(mesh.dp_group) == 0:
            rank_zero_warn(
                f"GPipeStrategy(trace_steps=...): step(s) {missed} never ran, so they were not traced; "
                f"this fit ended at step {step}"
            )


def _shared_origin(mine: int, header_group: dist.ProcessGroup) -> int:
    """Stages on stage 0's host share its monotonic clock, so they take its origin and line up exactly; stages
    elsewhere keep their own, taken as they left the barrier (aligned to within its release skew)."""
    here = (socket.gethostname(), mine)
    every: list[Any] = [None] * dist.get_world_size(header_group)
    dist.all_gather_object(every, here, group=header_group)
    host, origin = every[0]
    return origin if host == here[0] else mine
