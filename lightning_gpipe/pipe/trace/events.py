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


# A point in time as a timeline takes it: the host clock (ns), or on CUDA an event the stream reaches.
Mark = int | torch.cuda.Event


class Timeline:
    """Cheap event recorder: two clock reads and an append per event, nothing when disabled.

    Times come from ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux), which all processes on one host share, so
    the stages of a single-machine pipeline line up without clock synchronisation. On a CUDA ``device`` an event's
    ends are CUDA events recorded on the stream, so that it times the kernels' work, not their launch, and the host
    never waits for the device within a step (a synchronize after each send would make every send blocking, and the
    loss-inside schedules deadlock once messages exceed NCCL's buffers). They are read into the host clock when
    :attr:`events` is read, against an anchor: :meth:`anchor` (the one wait for the device, where a traced step
    begins), else the first event, taken as reached when recorded.
    """

    def __init__(self, stage: int, enabled: bool = False, device: Any = None) -> None:
        self.stage = stage
        self.enabled = enabled
        self._events: list[Event] = []
        self._cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self._pending: list[tuple[str, int, str, int, Mark, Mark]] = []  # recorded, not yet read into the host clock
        self._anchor: tuple[torch.cuda.Event, int] | None = None  # a device event and the host clock it meets

    @property
    def events(self) -> list[Event]:
        """The events recorded so far, in the host clock (on CUDA each waits for its own end event, not for the
        device: read them after the step)."""
        for kind, m, label, chunk, start, end in self._pending:
            self._events.append(Event(kind, self.stage, m, self._ns(start), self._ns(end), label, chunk))
        self._pending.clear()
        return self._events

    def anchor(self) -> int:
        """The host clock once the device's queued work is done (a wait for the device): where the device's times
        meet the host's. Call it between steps, never within one."""
        if not self._cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        self._anchor = (event, time.perf_counter_ns())
        return self._anchor[1]

    def mark(self) -> Mark:
        """Now: the host clock, or on CUDA (while enabled) an event the stream reaches after the work queued so far."""
        if not (self._cuda and self.enabled):
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._anchor is None:  # no anchor taken: this first event, as if the device reached it now
            self._anchor = (event, time.perf_counter_ns())
        return event

    def add(self, kind: str, start: Mark, end: Mark, micro_batch: int = -1, label: str = "", chunk: int = -1) -> None:
        """An event recorded by hand, between two :meth:`mark` s."""
        self._pending.append((kind, micro_batch, label, chunk, start, end))

    def end_of(self, kind: str, label: str = "") -> Mark | None:
        """Where the last event of ``kind`` (and ``label``) ended, without reading the device; None if none yet."""
        for k, _, lab, _, _, end in reversed(self._pending):
            if (k, lab) == (kind, label):
                return end
        ended = [e.end_ns for e in self._events if (e.kind, e.label) == (kind, label)]
        return ended[-1] if ended else None

    def _ns(self, mark: Mark) -> int:
        if isinstance(mark, int):
            return mark
        assert self._anchor is not None, "a CUDA mark is taken with an anchor"
        mark.synchronize()
        anchor, host = self._anchor
        return host + round(anchor.elapsed_time(mark) * 1e6)

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
        start = self.mark()
        try:
            yield
        finally:
            self.add(kind, start, self.mark(), micro_batch, label, chunk)

    def clear(self) -> None:
        self._events.clear()
        self._pending.clear()
        self._anchor = None


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
