"""The timeline on a CUDA device, its CUDA events stood in for on the CPU: within a step the host never waits for the
device (a synchronize after a send made every send blocking, and the loss-inside schedules deadlocked at K = 2 once
messages exceeded NCCL's buffers); the events are read into the host clock afterwards, against one anchor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_gpipe.pipe.trace import events as events_module
from lightning_gpipe.pipe.trace.events import Timeline


class _DeviceClock:
    """A CUDA stream's clock: an event is reached at the device time it was recorded (ms)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.waits: list[str] = []


def _fake_event(clock: _DeviceClock) -> type:
    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = clock.ms

        def synchronize(self) -> None:
            clock.waits.append("event")

        def elapsed_time(self, end: Any) -> float:
            return end.at - self.at

    return FakeEvent


@pytest.fixture
def device_clock(monkeypatch: pytest.MonkeyPatch) -> _DeviceClock:
    clock = _DeviceClock()
    monkeypatch.setattr(events_module.torch.cuda, "Event", _fake_event(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: clock.waits.append("device"))
    return clock


def test_a_traced_step_on_cuda_waits_for_no_device_until_its_events_are_read(device_clock: _DeviceClock) -> None:
    timeline = Timeline(0, enabled=True, device=torch.device("cuda", 0))
    host = timeline.anchor()  # between steps: the one wait
    assert device_clock.waits == ["event"]
    device_clock.waits.clear()
    for m in range(3):  # the step: a forward and a send per micro-batch, the device 2 ms and 1 ms on
        with timeline.record("forward", m):
            device_clock.ms += 2
        with timeline.record("send", m):
            device_clock.ms += 1
    start = timeline.mark()
    device_clock.ms += 5
    timeline.add("update", start, timeline.mark())
    assert timeline.end_of("send") is not None and timeline.end_of("recv-wait") is None
    assert device_clock.waits == []  # nothing waited for the device within the step
    got = [(e.kind, e.micro_batch, (e.start_ns - host) / 1e6, (e.end_ns - host) / 1e6) for e in timeline.events]
    assert got == [
        ("forward", 0, 0.0, 2.0), ("send", 0, 2.0, 3.0), ("forward", 1, 3.0, 5.0), ("send", 1, 5.0, 6.0),
        ("forward", 2, 6.0, 8.0), ("send", 2, 8.0, 9.0), ("update", -1, 9.0, 14.0),
    ]  # fmt: skip
    assert "device" not in device_clock.waits  # read event by event, never the whole device


def test_without_an_anchor_the_first_event_is_one(device_clock: _DeviceClock) -> None:
    """The engine's own timeline (GPipeStage(timeline=True)) takes no anchor: its first event is taken as reached
    when recorded, still without a wait."""
    timeline = Timeline(1, enabled=True, device="cuda")
    with timeline.record("forward", 0):
        device_clock.ms += 4
    assert device_clock.waits == []
    (event,) = timeline.events
    assert (event.end_ns - event.start_ns) / 1e6 == 4.0


def test_on_the_cpu_and_when_disabled_it_reads_the_host_clock() -> None:
    timeline = Timeline(0, enabled=True, device=torch.device("cpu"))
    assert isinstance(timeline.mark(), int) and isinstance(Timeline(0, device="cuda").mark(), int)
    with timeline.record("forward", 0):
        pass
    assert [e.kind for e in timeline.events] == ["forward"]
    timeline.clear()
    assert timeline.events == []
