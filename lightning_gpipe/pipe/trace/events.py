"""Per-stage timeline of pipeline events, exportable as a Chrome trace (chrome://tracing, Perfetto)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.pipe._torch_internals import profiler_enabled

# Event kinds a stage records: its compute (a split schedule's backward in two halves: "backward-input" and
# "backward-weight", see ``weight_grad``), its communication ("send" queues a message, "recv-wait" waits for one),
# "step" spans one whole forward or backward phase, "status" is the check at its end that every stage finished it
# (a small collective, so mostly waiting for the slowest stage).
COMPUTE = ("forward", "recompute", "backward", "backward-input", "backward-weight")
COMMUNICATION = ("recv-wait", "send")
ENGINE_KINDS = (*COMPUTE, *COMMUNICATION, "step", "status")
# The Lightning strategy adds "loss" (from the end of the forward phase to the start of the backward phase: the
# user's loss, and on the last stage its backward), "reduce" (gradient reductions over replicas and tied weights)
# and "update" (clipping and the optimizer step).
KINDS = (*ENGINE_KINDS, "loss", "reduce", "update")


@dataclass(frozen=True)
class Event:
    kind: str
    stage: int
    micro_batch: int  # -1 where the event belongs to no single micro-batch
    start_ns: int
    end_ns: int
    label: str = ""
    chunk: int = -1  # with several virtual stages per rank (interleaving), the rank's chunk (0: a, 1: b, …); else -1

    @property
    def name(self) -> str:
        """As traces and charts name it: kind, micro-batch and chunk letter, e.g. ``"forward 3b"``."""
        if self.micro_batch < 0:
            return self.kind
        return f"{self.kind} {self.micro_batch}{chunk_letter(self.chunk)}"


def chunk_letter(chunk: int) -> str:
    """A rank's chunk as schedules draw it (0: a, 1: b, …); nothing for -1 (one chunk per rank)."""
    return chr(ord("a") + chunk) if chunk >= 0 else ""


class Timeline:
    """Cheap event recorder: two clock reads and an append per event, nothing when disabled.

    Times come from ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux), which all processes on one host share, so
    the stages of a single-machine pipeline line up without clock synchronisation. On a CUDA ``device`` each event
    first waits for the queued kernels (only while enabled): otherwise it would time their launch, not their work.
    """

    def __init__(self, stage: int, enabled: bool = False, device: Any = None) -> None:
        self.stage = stage
        self.enabled = enabled
        self.events: list[Event] = []
        self._sync = None
        if device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda":
            self._sync = lambda: torch.cuda.synchronize(device)

    def now(self) -> int:
        """The clock, after the device's queued work while enabled (for events recorded by hand)."""
        if self.enabled and self._sync is not None:
            self._sync()
        return time.perf_counter_ns()

    @contextlib.contextmanager
    def record(self, kind: str, micro_batch: int = -1, label: str = "", chunk: int = -1) -> Iterator[None]:
        with (
            profiler_range(self.stage, kind, micro_batch, label, chunk),
            self._timed(kind, micro_batch, label, chunk),
        ):
            yield

    @contextlib.contextmanager
    def _timed(self, kind: str, micro_batch: int, label: str, chunk: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self._sync is not None:
            self._sync()
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.events.append(Event(kind, self.stage, micro_batch, start, time.perf_counter_ns(), label, chunk))

    def clear(self) -> None:
        self.events.clear()


def range_name(stage: int, kind: str, micro_batch: int = -1, label: str = "", chunk: int = -1) -> str:
    """The name torch's profiler shows for an event: ``"gpipe stage 1: backward 3"``, ``"gpipe stage 0: status"``
    (interleaved: ``"gpipe stage 1: forward 3b"``, chunk b of the rank)."""
    what = Event(kind, stage, micro_batch, 0, 0, label, chunk).name
    return f"gpipe stage {stage}: {what}" + (f" ({label})" if label else "")


def profiler_range(
    stage: int, kind: str, micro_batch: int = -1, label: str = "", chunk: int = -1
) -> contextlib.AbstractContextManager:
    """A ``record_function`` range while torch's profiler runs (``Trainer(profiler="pytorch")``), else nothing.

    Checked per event: a range costs about 10 µs even with no profiler, a check 0.2 µs.
    """
    if not profiler_enabled():
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(range_name(stage, kind, micro_batch, label, chunk))


def to_chrome_trace(events: Sequence[Event], metadata: dict | None = None) -> dict:
    """One process row per stage, one complete ("X") slice per event, times in microseconds from the first event;
    ``metadata`` goes to the trace's ``otherData``."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": metadata or {}}
    origin = min(e.start_ns for e in events)
    trace = []
    for stage in sorted({e.stage for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}})
    for e in events:
        trace.append(
            {
                "name": e.name,
                "cat": e.kind,
                "ph": "X",
                "pid": e.stage,
                # Communication on its own row keeps the compute row readable.
                "tid": 1 if e.kind in COMMUNICATION else 0,
                "ts": (e.start_ns - origin) / 1e3,
                "dur": (e.end_ns - e.start_ns) / 1e3,
                "args": {"micro_batch": e.micro_batch, "label": e.label, "chunk": e.chunk},
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_chrome_trace(events: Sequence[Event], path: str | os.PathLike, metadata: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events, metadata), f)


def read_chrome_trace(path: str | os.PathLike) -> list[Event]:
    """The events of a trace written by :func:`write_chrome_trace` (times in ns from its first event)."""
    with open(path) as f:
        trace = json.load(f)
    return [
        Event(
            e["cat"],
            e["pid"],
            e["args"]["micro_batch"],
            round(e["ts"] * 1e3),
            round((e["ts"] + e["dur"]) * 1e3),
            e["args"]["label"],
            e["args"].get("chunk", -1),  # traces written before interleaving have none
        )
        for e in trace["traceEvents"]
        if e["ph"] == "X"
    ]


def gather_events(timeline: Timeline, group: dist.ProcessGroup | None = None, origin_ns: int = 0) -> list[Event]:
    """Collect every stage's events on every rank of ``group`` (a collective: all ranks must call it).

    ``origin_ns`` is subtracted from this rank's times first: give each rank its clock reading at a common moment
    (just after a barrier) and stages on different hosts line up too.
    """
    mine = [{**asdict(e), "start_ns": e.start_ns - origin_ns, "end_ns": e.end_ns - origin_ns} for e in timeline.events]
    if not dist.is_initialized():
        return sorted((Event(**e) for e in mine), key=lambda e: e.start_ns)
    gathered: list[list[dict] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return sorted((Event(**e) for part in gathered for e in part or []), key=lambda e: e.start_ns)
