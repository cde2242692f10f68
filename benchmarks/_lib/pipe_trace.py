"""One traced step of a lightning_gpipe pipeline: its Chrome trace and where each stage's time went."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from benchmarks._lib.machine import Timing, pause_until_quiet, timed
from lightning_gpipe.pipe import GPipeStage, gather_events, write_chrome_trace
from lightning_gpipe.pipe.trace.events import COMPUTE


def trace_step(stage: GPipeStage, step: Callable[[], Any], timing: Timing, path: str) -> dict:
    """One extra step with the timeline on (the first clean one of up to 5), written to ``path`` as a Chrome trace.

    A collective: every rank calls it; rank 0 gets the summary (span, the step's ``timed`` record, per-stage times),
    the others ``{}``.
    """
    for _attempt in range(5):
        pause_until_quiet(timing.wait_quiet / 4, timing.clean_threshold)
        stage.zero_grad(set_to_none=True)
        stage.timeline.clear()
        stage.timeline.enabled = True
        rec, _ = timed(step)
        stage.timeline.enabled = False
        if rec["foreign_cores"] < timing.clean_threshold:
            break
    events = gather_events(stage.timeline)
    stage.timeline.clear()
    if dist.get_rank() != 0:
        return {}
    write_chrome_trace(events, path)
    return _summary(events, path, rec)


def _ms(e: Any) -> float:
    return (e.end_ns - e.start_ns) / 1e6


def _summary(events: list, path: str, rec: dict) -> dict:
    """The step's span and, per stage, time per event kind, per phase and per compute unit (median), in ms."""
    steps = [e for e in events if e.kind == "step"]
    span = (max(e.end_ns for e in steps) - min(e.start_ns for e in steps)) / 1e6
    summary: dict[str, Any] = {"path": path, "span_ms": span, "step": rec, "stages": {}}
    for k in sorted({e.stage for e in events}):
        mine = [e for e in events if e.stage == k]
        per_kind: dict[str, float] = {}
        for e in mine:
            if e.kind != "step":
                per_kind[e.kind] = per_kind.get(e.kind, 0.0) + _ms(e)
        busy = sum(per_kind.get(kind, 0.0) for kind in COMPUTE)
        summary["stages"][str(k)] = {
            "ms_per_kind": per_kind,
            "phase_ms": {e.label: _ms(e) for e in mine if e.kind == "step"},
            "compute_ms": busy,
            "compute_fraction_of_span": busy / span if span else None,
            "median_unit_ms": {
                kind: statistics.median(_ms(e) for e in mine if e.kind == kind) for kind in COMPUTE if kind in per_kind
            },
        }
    return summary


def stage_lines(summary: dict) -> list[str]:
    """``trace_step``'s per-stage breakdown, one printable line per stage."""
    lines = []
    for k, st in summary["stages"].items():
        kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["ms_per_kind"].items())
        units = ", ".join(f"{kind} {ms:.1f}" for kind, ms in st["median_unit_ms"].items())
        lines.append(
            f"  stage {k}: compute {st['compute_ms']:.1f} ms = {100 * st['compute_fraction_of_span']:.0f}% of the "
            f"span; totals [ms] {kinds}; median per micro-batch [ms] {units}"
        )
    return lines
