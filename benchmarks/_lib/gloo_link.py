"""A gloo link between two processes, measured: latency and bandwidth by ping-pong, each end's host time per message."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.pipe.comm.framing import TensorMeta
from lightning_gpipe.pipe.comm.transport import Transport


@dataclass(frozen=True)
class Link:
    """One message's time between two processes: ``latency`` + bytes / ``bandwidth`` (bytes per second); and its
    host time on each end (seconds: fixed, per tensor), which the ranks spend, not the link (``fit_host``)."""

    latency: float
    bandwidth: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (bytes, one-way seconds) measured
    send_host: tuple[float, float] = (0.0, 0.0)  # posting a send: the header, an isend per tensor
    recv_host: tuple[float, float] = (0.0, 0.0)  # posting a receive whose shapes are known, and reading it
    host_samples: list[tuple[int, float, float]] = field(default_factory=list)  # (tensors, send s, receive s)

    def time(self, sizes: Sequence[int]) -> float:
        """A send of these tensors as the transport makes it: a header, then each tensor."""
        return self.latency + sum(self.latency + b / self.bandwidth for b in sizes)

    def sender(self, sizes: Sequence[int]) -> float:
        """The sending rank's own time for a message of these tensors (the transport sends no empty one)."""
        return self.send_host[0] + self.send_host[1] * sum(1 for b in sizes if b)

    def receiver(self, sizes: Sequence[int]) -> float:
        """The receiving rank's own time for a message of these tensors posted before it came (an output gradient)."""
        return self.recv_host[0] + self.recv_host[1] * sum(1 for b in sizes if b)


def ping_pong(peer: int, sizes: Sequence[int], repeat: int = 9) -> list[tuple[int, float]]:
    """(bytes, one-way seconds: median round trip / 2) per size, with ``peer`` (which calls ``echo``) over gloo."""
    out = []
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1))
        trips = []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            dist.send(buf, peer)
            dist.recv(buf, peer)
            trips.append(time.perf_counter() - start)
        out.append((buf.numel() * 4, statistics.median(trips[1:]) / 2))
    return out


def echo(peer: int, sizes: Sequence[int], repeat: int = 9) -> None:
    """The other end of ``ping_pong``."""
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1))
        for _ in range(repeat + 1):
            dist.recv(buf, peer)
            dist.send(buf, peer)


def fit_link(samples: Sequence[tuple[int, float]]) -> Link:
    """Least squares of time = latency + bytes / bandwidth over the samples (latency ≥ 0)."""
    xs, ys = [float(b) for b, _ in samples], [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return Link(max(my - slope * mx, 0.0), 1.0 / slope, list(samples))


def fit_host(link: Link, samples: Sequence[tuple[int, float, float]]) -> Link:
    """``link`` with its host times: least squares of each end's time = fixed + per tensor × tensors (each ≥ 0) over
    ``samples`` of (tensors, send seconds, receive seconds), as ``message_host`` measures them."""

    def line(ys: list[float]) -> tuple[float, float]:
        xs = [float(n) for n, _, _ in samples]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        spread = sum((x - mx) ** 2 for x in xs)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread, 0.0) if spread else 0.0
        return max(my - slope * mx, 0.0), slope

    send, recv = line([t for _, t, _ in samples]), line([t for _, _, t in samples])
    return replace(link, send_host=send, recv_host=recv, host_samples=[(int(n), s, r) for n, s, r in samples])


HOST_TENSORS = (1, 2, 3, 4)  # tensors per message, each of HOST_BYTES, for ``message_host``'s fit
HOST_BYTES = 64 << 10


def message_host(pair: Any, repeat: int = 15) -> list[tuple[int, float, float]]:
    """On both ranks of the group ``pair``, through a ``Transport`` on it as a stage uses one: per message of n
    tensors, (n, the sender's seconds in ``send`` + ``retire_sends`` as ``Links.send`` runs them, the
    receiver's in ``post_recv`` with the shapes known + ``wait`` once the message is there, as ``backward_micro`` runs
    them); medians over ``repeat`` messages each way, after one. Host time only: each timed call finds its peer
    ready (the receive posted before the send; the bytes given 2 ms to land before the wait)."""
    rank = dist.get_rank(pair)
    peer = 1 - rank
    transport = Transport(pair, device=torch.device("cpu"), timeout=timedelta(seconds=60))
    out = []
    for n in HOST_TENSORS:
        obj = [torch.zeros(HOST_BYTES // 4) for _ in range(n)]
        metas = [TensorMeta(t.dtype, tuple(t.shape), False) for t in obj]
        send: list[float] = []
        recv: list[float] = []
        for i in range(2 * (repeat + 1)):
            sender = i % 2 == rank  # by turns, so that each rank plays both ends
            if not sender:
                start = time.perf_counter()
                pending = transport.post_recv(peer, "a message", expect=metas)
                posted = time.perf_counter() - start
            dist.barrier(pair)
            if sender:
                start = time.perf_counter()
                transport.send(peer, obj, m=i, stage=rank)
                transport.retire_sends()
                send.append(time.perf_counter() - start)
            else:
                time.sleep(0.002)
                start = time.perf_counter()
                pending.wait()
                recv.append(posted + time.perf_counter() - start)
            transport.wait_sends()
            dist.barrier(pair)
        times = torch.tensor([statistics.median(send[1:]), statistics.median(recv[1:])], dtype=torch.float64)
        dist.all_reduce(times, group=pair)  # both ends' medians, averaged
        out.append((n, float(times[0]) / 2, float(times[1]) / 2))
    return out
